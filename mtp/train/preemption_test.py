"""Stop signals: one process's own flag (SIGTERM, SIGUSR1), and a multi-process run's questions
to JAX's preemption sync point, here a stand-in (tests/multihost_test.py runs the real one)."""

import os
import signal

import jax
import pytest
from jax.experimental import multihost_utils

from mtp.train import preemption


@pytest.fixture
def handlers():
  """The stop signals' handlers, put back after the test."""
  saved = {s: signal.getsignal(s) for s in preemption.STOP_SIGNALS}
  yield saved
  for signum, handler in saved.items():
    signal.signal(signum, handler)


@pytest.mark.parametrize('signum', preemption.STOP_SIGNALS, ids=lambda s: s.name)
def test_one_process_a_stop_signal_sets_the_flag_and_handlers_come_back(handlers, signum):
  with preemption.StopRequest(5) as stop:
    assert not stop.at(6)
    os.kill(os.getpid(), signum)
    assert stop.at(7) and stop.reason == signum.name
  assert {s: signal.getsignal(s) for s in handlers} == handlers
  error = preemption.Preempted(7, stop.reason)
  assert str(error) == (f'preempted ({signum.name}): saved a checkpoint at step 7; run the same '
                        'command again to resume.')


@pytest.fixture
def two_processes(monkeypatch, handlers):
  """A run of two processes whose sync point is reached at counter 3; returns its calls."""
  del handlers
  calls = []

  def reached(counter):
    calls.append(counter)
    return counter == 3
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'reached_preemption_sync_point', reached)
  monkeypatch.setattr(preemption, '_begun', False)
  return calls


def test_several_processes_stop_at_the_agreed_step(two_processes, monkeypatch):
  sigterm = signal.getsignal(signal.SIGTERM)
  preemption.begin()
  preemption.begin()  # Once per process.
  assert two_processes == [0]
  with preemption.StopRequest(start_step=10) as stop:
    # JAX's C++ handler keeps SIGTERM: no Python handler replaces it.
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert [stop.at(step) for step in (11, 12, 13)] == [False, False, True]
  assert two_processes == [0, 1, 2, 3]  # Steps since the start: the same on every process.
  assert stop.reason == 'SIGTERM or SIGUSR1 to a process of the run'
  # SIGUSR1 becomes a SIGTERM, the notice JAX's preemption service listens for.
  sent = []
  monkeypatch.setattr(os, 'kill', lambda pid, signum: sent.append((pid, signum)))
  signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)
  assert sent == [(os.getpid(), signal.SIGTERM)]


def test_without_the_preemption_service_each_process_is_on_its_own(two_processes, monkeypatch):
  def disabled(counter):
    raise RuntimeError('Preemption sync manager has not been initialized.')
  monkeypatch.setattr(multihost_utils, 'reached_preemption_sync_point', disabled)
  preemption.begin()
  with preemption.StopRequest(0) as stop:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.at(1) and stop.reason == 'SIGUSR1'
  assert not two_processes
