"""Multi-process training on localhost through launch.multiprocess, as a pod runs launch.train:
two processes (jax.distributed, gloo, one CPU device each) train like one process on the same
batches, and a process killed mid-run stops the run with one line naming it; without the runner,
the heartbeat timeout ends the survivor."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from launch import multiprocess
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / 'configs' / 'tiny.py')


def _runner(workdir, num_processes, *train_flags, grace_s=10):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)  # One CPU device per process.
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
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  env.pop('XLA_FLAGS', None)
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
