"""Preemption: SIGTERM or SIGUSR1 becomes a request to save a checkpoint and stop at a step
boundary; the loop then raises `Preempted`, so that callers (and, through launch.train's exit
code 143, schedulers) can tell a preempted run from a finished one.

SIGUSR1 is SLURM's warning before the time limit (launch/slurm_gpu.sbatch: the batch script
requeues the job once the tasks have saved), treated like SIGTERM; both exit with 143.

One process: a Python handler sets a flag, and the loop saves after the step it is in.

Several processes (`jax.process_count() > 1`): a pod's hosts get the maintenance signal at
different moments, possibly one host alone, and a collective save needs every process at the
same step. The agreement is JAX's preemption service, which `jax.distributed.initialize` starts
(`multihost_utils.reached_preemption_sync_point`):

- Its notifier installs a C++ SIGTERM handler in every process. A process that gets SIGTERM
  writes a notice to the coordination service (its listener thread polls once a second); every
  process sees the notice, and background threads post each one's last call counter, meet at a
  barrier and set the sync point to the largest counter plus one. The training thread never
  waits for a peer, so a process stuck in a collective still takes part, and asking costs a
  mutex, not a collective: no per-step all-reduce of a 'stop' flag is needed.
- The loop asks `reached_preemption_sync_point` once per step, on every process, with the same
  counters: 0 before the loop (`begin`), then the steps taken since the start. Counting from
  the start rather than by step number, a notice during the setup (counter 0 everywhere,
  whatever step the run resumes from) stops the run after its first step.
- So no Python SIGTERM handler is installed there (it would replace JAX's), and SIGUSR1's handler
  sends the process SIGTERM, which JAX's handler takes as the notice.
- Orbax's CheckpointManager asks the sync point too, with the step it saves (in `save`, and
  later from its finalize thread), which would move the counters off the loop's; the project's
  manager answers those calls itself (mtp/checkpoint/checkpointing.py).

Measured with the installed jax (0.10.2), gloo on CPU: SIGTERM (or SIGUSR1) to one process of
two alone stops both at the same step, about a second later (tests/multihost_test.py). Where
the preemption service is disabled (`jax_enable_preemption_service=False`) each process is on
its own, as with one process, and a signal must reach every process.
"""

from __future__ import annotations

import os
import signal

from absl import logging

# The signals that ask for a checkpoint and a stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_AGREED = 'SIGTERM or SIGUSR1 to a process of the run'

_begun = False  # `begin` ran in this process (once per process: the sync point's counters).


class Preempted(Exception):
  """Training stopped on a stop signal after saving its checkpoint at `step`; run again to
  resume."""

  def __init__(self, step: int, reason: str = 'SIGTERM'):
    super().__init__(f'preempted ({reason}): saved a checkpoint at step {step}; run the same '
                     'command again to resume.')
    self.step = step
    self.reason = reason


def _sync_point(counter: int) -> bool | None:
  """JAX's preemption sync point at `counter`; None where there is none (one process, or the
  preemption service disabled)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return None
  try:
    return multihost_utils.reached_preemption_sync_point(counter)
  except RuntimeError:  # jax_enable_preemption_service=False.
    return None


def begin() -> None:
  """Makes a multi-process run agree on stop signals from now on (a no-op for one process).

  Call it once per process, as early as possible after `jax.distributed.initialize`: it sets
  the sync point's counter to 0 (a notice before then has no counter to agree on and is lost)
  and makes SIGUSR1 a SIGTERM, for the process's lifetime.
  """
  global _begun
  if _begun:
    return
  if _sync_point(0) is None:
    import jax  # pylint: disable=import-outside-toplevel
    if jax.process_count() > 1:
      logging.warning('JAX\'s preemption service is disabled: a stop signal is handled by the '
                      'process that gets it alone; send it to every process.')
    return
  _begun = True
  try:
    signal.signal(signal.SIGUSR1, _usr1_as_sigterm)
  except ValueError:  # Not the main thread.
    logging.warning('Not the main thread: SIGUSR1 does not stop training.')


def _usr1_as_sigterm(signum, frame):
  del signum, frame
  logging.warning('SIGUSR1 received: passed on as SIGTERM to JAX\'s preemption service.')
  os.kill(os.getpid(), signal.SIGTERM)


class StopRequest:
  """Within `with StopRequest(start_step) as stop:`, `stop.at(step)` says whether to save and
  stop after `step`; ask it once per step, on every process.

  One process (or no preemption service): SIGTERM and SIGUSR1 set a flag instead of killing.
  Several, after `begin()`: the agreed step of JAX's preemption sync point.
  """

  def __init__(self, start_step: int = 0):
    self._start_step = start_step
    self._agreed = _begun
    self.reason: str | None = None  # What stopped the run, for `Preempted`.
    self._previous = {}

  def __enter__(self):
    if self._agreed:
      return self  # JAX's handler has SIGTERM; `begin` made SIGUSR1 a SIGTERM.
    for signum in STOP_SIGNALS:
      try:
        self._previous[signum] = signal.signal(signum, self._handle)
      except ValueError:  # Not the main thread: no signal handling.
        break
    return self

  @property
  def requested(self) -> bool:
    """A stop was asked of this process (one process: by a signal)."""
    return self.reason is not None

  def at(self, step: int) -> bool:
    """Whether to save and stop after `step` (steps count on from `start_step`, one a call)."""
    if self._agreed:
      if _sync_point(step - self._start_step):
        self.reason = _AGREED
    return self.requested

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    logging.warning('%s received: saving a checkpoint and stopping.', name)
    self.reason = self.reason or name

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      if previous is not None:  # None: a handler Python did not install, which it cannot restore.
        signal.signal(signum, previous)
    self._previous = {}
