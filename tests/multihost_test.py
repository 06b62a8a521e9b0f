"""Multi-process training on localhost through launch.multiprocess, as a pod runs launch.train:
two processes (jax.distributed, gloo, one CPU device each) train like one process on the same
batches, and a process killed mid-run stops the run with one line naming it; without the runner,
the heartbeat timeout ends the survivor; a stop signal to one process alone makes both save the
same step, and the resumed run matches an uninterrupted one bit for bit."""

import functools
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from launch import cli
from launch import multiprocess
from mtp import testing as mtp_testing
from mtp.checkpoint import checkpointing
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / 'configs' / 'tiny.py')


def _runner(workdir, num_processes, *train_flags, grace_s=10):
  env = mtp_testing.child_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')  # One device each.
  return subprocess.Popen(
      [sys.executable, '-m', 'launch.multiprocess', f'--num_processes={num_processes}',
       f'--grace_s={grace_s}', '--', f'--config={TINY}', f'--workdir={workdir}',
       '--config.log_every_steps=1', '--config.eval_steps=0', *train_flags],
      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  for name, n in (('one', 1), ('two', 2)):
    runner = _runner(tmp_path / name, n, '--config.num_train_steps=3',
                     '--config.checkpoint_every_steps=3')
    out = runner.communicate(timeout=600)[0]
    assert runner.returncode == 0, out[-3000:]
  assert re.search(r'^\[1\] .*Process 1 of 2\.$', out, re.M), out[-3000:]
  one = [r['loss'] for r in writers.read_metrics(tmp_path / 'one') if 'loss' in r]
  two = [r['loss'] for r in writers.read_metrics(tmp_path / 'two') if 'loss' in r]
  assert len(one) == len(two) == 3
  np.testing.assert_allclose(two, one, rtol=1e-4)
  assert (tmp_path / 'two' / 'checkpoints' / '3').is_dir()


@pytest.mark.slow
def test_a_killed_process_stops_the_run_with_one_line_naming_it(tmp_path):
  grace_s = 5
  runner = _runner(tmp_path, 2, '--config.num_train_steps=100000', grace_s=grace_s)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(runner.stdout), daemon=True)
  reader.start()
  metrics = tmp_path / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while not (metrics.exists() and metrics.stat().st_size):  # Until a step is trained.
    assert runner.poll() is None and time.monotonic() < deadline, ''.join(lines)[-3000:]
    time.sleep(0.2)
  match = re.search(r'started 2 processes, pids (\d+) (\d+)', ''.join(lines))
  pids = [int(match.group(1)), int(match.group(2))]
  os.kill(pids[1], signal.SIGKILL)
  killed_at = time.monotonic()
  runner.wait(timeout=120)
  elapsed = time.monotonic() - killed_at
  reader.join(timeout=10)
  out = ''.join(lines)
  assert runner.returncode == 1
  assert out.splitlines()[-1] == (f'launch.multiprocess: process 1 of 2 (pid {pids[1]}) was '
                                  'killed by SIGKILL; stopped the other 1.')
  # Noticing takes a poll; process 0, stuck in a collective or in JAX's shutdown barrier,
  # gets SIGTERM, then SIGKILL after the grace period.
  assert elapsed < grace_s + 10, elapsed
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


@pytest.mark.slow
def test_without_the_runner_a_dead_peer_ends_the_survivor_within_the_heartbeat_timeout(tmp_path):
  """A pod has no runner watching its workers: launch.train's --heartbeat_timeout_s bounds how
  long the survivors wait for a dead one (JAX's coordination service, on process 0, stops
  hearing from it and ends every process)."""
  heartbeat_s = 5
  env = mtp_testing.child_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  commands = multiprocess.process_commands(
      'launch.train', [f'--config={TINY}', f'--workdir={tmp_path}', '--config.log_every_steps=1',
                       '--config.eval_steps=0', '--config.num_train_steps=100000',
                       f'--heartbeat_timeout_s={heartbeat_s}'],
      2, f'localhost:{multiprocess.free_port()}')
  logs = [open(tmp_path / f'log{i}.txt', 'w') for i in range(2)]  # pylint: disable=consider-using-with
  procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
           for c, log in zip(commands, logs)]
  try:
    metrics = tmp_path / 'metrics.jsonl'
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size):
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
      time.sleep(0.2)
    procs[1].kill()
    killed_at = time.monotonic()
    code = procs[0].wait(timeout=heartbeat_s + 60)
    elapsed = time.monotonic() - killed_at
  finally:
    for p in procs:
      p.kill()
      p.wait()
    for log in logs:
      log.close()
  assert code != 0
  assert elapsed < heartbeat_s + 30, elapsed
  assert 'heartbeat' in (tmp_path / 'log0.txt').read_text()


class _Run:
  """The two launch.train processes of one run, started side by side without the runner (each
  one's exit code is checked), their output in log files."""

  def __init__(self, workdir: pathlib.Path, name: str, *train_flags: str):
    env = mtp_testing.child_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu',  # One device each.
                               PYTHONUNBUFFERED='1')
    env.pop('MTP_TRACEBACK', None)
    commands = multiprocess.process_commands(
        'launch.train', [f'--config={TINY}', f'--workdir={workdir}', '--config.log_every_steps=1',
                         '--config.eval_steps=0', '--config.checkpoint_every_steps=1000',
                         *train_flags], 2, f'localhost:{multiprocess.free_port()}')
    self.workdir = workdir
    self.logs = [workdir.parent / f'{name}.log{i}' for i in range(2)]
    self.procs = []
    for command, log in zip(commands, self.logs):
      with open(log, 'w') as out:
        self.procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=out,
                                           stderr=subprocess.STDOUT))

  def output(self) -> str:
    return ''.join(f'--- process {i}:\n' + log.read_text()[-3000:]
                   for i, log in enumerate(self.logs))

  def wait_for(self, condition, timeout_s: float = 300) -> None:
    """Until `condition()`; a process that ends first or the timeout ends the run and fails."""
    deadline = time.monotonic() + timeout_s
    while not condition():
      if not all(p.poll() is None for p in self.procs) or time.monotonic() > deadline:
        self.kill()
        raise AssertionError(self.output())
      time.sleep(0.05)

  def trained_to(self, step: int) -> bool:
    return any(r.get('step', 0) >= step and 'loss' in r
               for r in writers.read_metrics(self.workdir))

  def logged(self, index: int, text: str) -> bool:
    return text in self.logs[index].read_text()

  def finish(self) -> list[int]:
    """The exit codes (the processes are killed after 300 s)."""
    try:
      return [p.wait(timeout=300) for p in self.procs]
    finally:
      self.kill()

  def kill(self) -> None:
    for p in self.procs:
      p.kill()
      p.wait()


def _saved_steps(run: _Run) -> list[int]:
  """The step each process says it saved before stopping."""
  steps = []
  for log in run.logs:
    found = re.findall(r'^launch\.train: preempted \(SIGTERM or SIGUSR1 to a process of the '
                       r'run\): saved a checkpoint at step (\d+);', log.read_text(), re.M)
    assert len(found) == 1, run.output()
    steps.append(int(found[0]))
  return steps


def _losses(workdir):
  return {r['step']: r['loss'] for r in writers.read_metrics(workdir) if 'loss' in r}


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_step_and_resumes_exactly(tmp_path):
  """SIGTERM to process 1 alone at a random step: both processes save the same step and exit
  with 143 (JAX's preemption sync point). Resumed, SIGUSR1 (SLURM's warning) to process 0 alone
  does the same, and every loss logged up to there, those of the resumed run included, is the
  uninterrupted run's, bit for bit.

  While the notice travels (JAX's notifier polls once a second), the other process is paused
  (SIGSTOP), a slow host: the stop step is then a few steps after the signal at any speed.
  """
  seed = random.randrange(1 << 30)
  rng = random.Random(seed)
  num_steps = 30
  straight = _Run(tmp_path / 'straight', 'straight', f'--config.num_train_steps={num_steps}')
  assert straight.finish() == [0, 0], straight.output()

  workdir = tmp_path / 'interrupted'
  saved = 0
  for signalled, signum, paused in ((1, signal.SIGTERM, 0), (0, signal.SIGUSR1, 1)):
    run = _Run(workdir, f'stopped_by_{signum.name}', f'--config.num_train_steps={num_steps}')
    at_step = saved + rng.randint(2, 6)
    run.wait_for(functools.partial(run.trained_to, at_step))
    run.procs[signalled].send_signal(signum)
    if signum == signal.SIGUSR1:  # Its Python handler passes it on as a SIGTERM.
      run.wait_for(functools.partial(run.logged, signalled, 'SIGUSR1 received'))
    run.procs[paused].send_signal(signal.SIGSTOP)
    time.sleep(2)
    run.procs[paused].send_signal(signal.SIGCONT)
    codes = run.finish()
    context = f'seed {seed}, {signum.name} to process {signalled} at step {at_step}'
    assert codes == [cli.PREEMPTED, cli.PREEMPTED], (context, codes, run.output())
    steps = _saved_steps(run)
    assert steps[0] == steps[1], (context, steps)
    assert at_step <= steps[0] < num_steps, (context, steps)
    saved = steps[0]
    assert checkpointing.Checkpointer(workdir, read_only=True).latest_step() == saved, context
    expected, got = _losses(tmp_path / 'straight'), _losses(workdir)
    assert sorted(got) == list(range(1, saved + 1)), context
    for step in got:
      assert got[step] == expected[step], (context, step, got[step], expected[step])
