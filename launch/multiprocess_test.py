"""The local multi-process runner on plain Python processes (no JAX): commands, prefixed output,
and a failed process stopping the others within the grace period. The JAX runs through it are in
tests/multihost_test.py."""

import io
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launch import multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> list[str]:
  return [sys.executable, '-c', textwrap.dedent(code)]


def test_each_process_gets_its_place_in_the_run():
  commands = multiprocess.process_commands('launch.train', ['--config=c.py', '--workdir=w'], 2,
                                           'localhost:1234', python='py')
  assert commands == [
      ['py', '-m', 'launch.train', '--config=c.py', '--workdir=w', '--num_processes=2',
       '--process_id=0', '--coordinator_address=localhost:1234'],
      ['py', '-m', 'launch.train', '--config=c.py', '--workdir=w', '--num_processes=2',
       '--process_id=1', '--coordinator_address=localhost:1234']]
  with pytest.raises(ValueError, match='num_processes'):
    multiprocess.process_commands('m', [], 0, 'localhost:1')


def test_all_succeed_and_each_line_carries_its_process():
  out, err = io.StringIO(), io.StringIO()
  code = multiprocess.run([_python('print("hello")'), _python('print("hi"); print("bye")')],
                          out=out, err=err)
  assert code == 0
  assert sorted(out.getvalue().splitlines()) == ['[0] hello', '[1] bye', '[1] hi']
  assert 'started 2 processes' in err.getvalue()


def test_a_failure_stops_the_others_and_is_named_in_one_line():
  out, err = io.StringIO(), io.StringIO()
  start = time.monotonic()
  code = multiprocess.run([_python('import time; time.sleep(60)'),
                           _python('import sys; sys.exit(3)')], grace_s=30, out=out, err=err)
  # SIGTERM ends the sleeper at once: well inside the grace period.
  assert time.monotonic() - start < 20
  assert code == 3
  last = err.getvalue().splitlines()[-1]
  assert last.startswith('launch.multiprocess: process 1 of 2 (pid ')
  assert last.endswith(') exited with code 3; stopped the other 1.')


def test_a_preempted_process_is_no_failure_and_the_others_finish_saving():
  """Exit 143 on its own (a SIGTERM to that process alone): the others are saving the same
  step (JAX's preemption service), so the runner waits for them instead of stopping them."""
  out, err = io.StringIO(), io.StringIO()
  code = multiprocess.run([_python('import sys; sys.exit(143)'),
                           _python("import sys, time; time.sleep(3); print('saved', flush=True); "
                                   'sys.exit(143)')], grace_s=0.5, out=out, err=err)
  assert code == 143
  assert out.getvalue().splitlines() == ['[1] saved']  # Not stopped after the grace period.
  lines = err.getvalue().splitlines()
  assert lines[-1] == ('launch.multiprocess: process 0 of 2 was preempted (exit 143); waiting '
                       'for the others to save the same step.')


def test_a_process_deaf_to_sigterm_is_killed_after_the_grace_period():
  err = io.StringIO()
  deaf = _python('''
      import signal, time
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      print('ready', flush=True)
      time.sleep(60)''')
  killed = _python('import os, signal, time; time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)')
  start = time.monotonic()
  code = multiprocess.run([deaf, killed], grace_s=1, out=io.StringIO(), err=err)
  assert time.monotonic() - start < 20
  assert code == 1
  assert 'process 1 of 2' in err.getvalue() and 'was killed by SIGKILL' in err.getvalue()


def test_sigterm_to_the_runner_reaches_every_process_and_it_waits_for_them(tmp_path):
  child = textwrap.dedent(f'''
      import pathlib, signal, sys, time
      def stop(*_):
        pathlib.Path({str(tmp_path)!r}, sys.argv[-2]).write_text('saved')
        sys.exit(143)
      signal.signal(signal.SIGTERM, stop)
      print('ready', flush=True)
      time.sleep(60)''')
  script = tmp_path / 'child.py'
  script.write_text(child)
  # A module path the runner can start: the child script as `-m child` from tmp_path.
  env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{tmp_path}')
  runner = subprocess.Popen([sys.executable, '-m', 'launch.multiprocess', '--num_processes=2',
                             '--module=child', '--'], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ready = 0
  for line in runner.stdout:
    ready += line.rstrip().endswith('ready')
    if ready == 2:
      break
  runner.send_signal(signal.SIGTERM)
  runner.communicate(timeout=30)
  assert runner.returncode == 143
  # Each child saw its own --process_id flag, and saved on SIGTERM.
  assert sorted(p.name for p in tmp_path.glob('--process_id=*')) == [
      '--process_id=0', '--process_id=1']
