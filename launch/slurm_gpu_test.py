"""launch/slurm_gpu.sbatch under a stand-in `srun`: the exact command every task runs, the
named errors for missing variables, SLURM's SIGUSR1 before the time limit passed on to the tasks
and the job requeued once they have saved (stand-in `srun` and `scontrol` recording their calls),
and (slow) two tasks on this machine that find their place in the run through JAX's SLURM
auto-detection alone."""

import json
import os
import pathlib
import re
import stat
import subprocess
import signal
import sys
import textwrap
import time

import pytest

from launch import multiprocess
from mtp import testing as mtp_testing
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'launch' / 'slurm_gpu.sbatch'


def _fake(directory: pathlib.Path, name: str, body: str) -> None:
  """A Python executable `name` in `directory`."""
  path = directory / name
  path.write_text(f'#!{sys.executable}\n' + textwrap.dedent(body))
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fake_srun(directory: pathlib.Path, body: str) -> dict:
  """An `srun` executable in `directory`, first on PATH in the returned environment."""
  _fake(directory, 'srun', body)
  # One CPU device per task.
  env = {k: v for k, v in mtp_testing.child_env().items() if not k.startswith('SLURM_')}
  env['PATH'] = f'{directory}{os.pathsep}{env["PATH"]}'
  return env


def _sbatch(env, *args):
  return subprocess.run(['bash', str(SCRIPT), *args], env=env, capture_output=True, text=True,
                        timeout=600, cwd=ROOT)


def test_every_task_runs_launch_train_with_auto_detection(tmp_path):
  env = _fake_srun(tmp_path, '''
      import json, os, sys
      print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:]}))''')
  env.update(CONFIG='configs/code_small.py', WORKDIR='/shared/runs/a b', MTP_DIR=str(ROOT))
  done = _sbatch(env, '--config.num_train_steps=20000', '--config.data.corpus=/data/x y')
  assert done.returncode == 0, done.stderr
  ran = json.loads(done.stdout)
  assert ran == {'cwd': str(ROOT), 'argv': [
      '--kill-on-bad-exit=1', 'python3', '-m', 'launch.train', '--config=configs/code_small.py',
      '--workdir=/shared/runs/a b', '--num_processes=-1', '--heartbeat_timeout_s=100',
      '--config.num_train_steps=20000', '--config.data.corpus=/data/x y']}


@pytest.mark.parametrize('missing', ['CONFIG', 'WORKDIR'])
def test_a_missing_variable_is_named(tmp_path, missing):
  env = _fake_srun(tmp_path, 'raise SystemExit("srun must not run")')
  env.update(CONFIG='configs/tiny.py', WORKDIR='/w')
  del env[missing]
  done = _sbatch(env)
  assert done.returncode != 0
  assert f'{missing}: set {missing}' in done.stderr


def test_the_directives_ask_one_task_per_gpu_per_node():
  directives = dict(re.findall(r'^#SBATCH --([\w-]+)(?:=(\S+))?', SCRIPT.read_text(), re.M))
  assert directives['ntasks-per-node'] == directives['gpus-per-node']
  assert 'gpus-per-task' not in directives  # Each task must see every GPU of its node.
  # SIGUSR1 to the batch shell 3 minutes before the time limit; the script requeues the job.
  assert directives['signal'] == 'B:USR1@180' and 'requeue' in directives


# The task srun starts: it saves on SIGUSR1 (a line in the calls file) and exits with
# `exit_code`, as launch.train does with 143 (or 0: the run happened to finish then).
_TASK = '''
import pathlib, signal, sys, time
calls = pathlib.Path(sys.argv[1])
def save(signum, frame):
  with calls.open('a') as f:
    f.write(f'task saved on {signal.Signals(signum).name}\\n')
  sys.exit(int(sys.argv[2]))
signal.signal(signal.SIGUSR1, save)
pathlib.Path(sys.argv[3]).write_text('ready')
time.sleep(60)
sys.exit(1)
'''


@pytest.mark.parametrize('exit_code, requeued', [(143, True), (0, False)])
def test_usr1_before_the_time_limit_saves_then_requeues_the_job(tmp_path, exit_code, requeued):
  calls = tmp_path / 'calls.txt'
  ready = tmp_path / 'ready'
  # srun's part: record the call, start the task, forward SIGUSR1 to it, exit with its code.
  env = _fake_srun(tmp_path, f'''
      import pathlib, signal, subprocess, sys
      with open({str(calls)!r}, 'a') as f:
        f.write('srun ' + ' '.join(sys.argv[1:]) + '\\n')
      task = subprocess.Popen([sys.executable, '-c', {_TASK!r}, {str(calls)!r},
                               '{exit_code}', {str(ready)!r}])
      signal.signal(signal.SIGUSR1, lambda signum, frame: task.send_signal(signum))
      sys.exit(task.wait())''')
  _fake(tmp_path, 'scontrol', f'''
      import sys
      with open({str(calls)!r}, 'a') as f:
        f.write('scontrol ' + ' '.join(sys.argv[1:]) + '\\n')''')
  env.update(CONFIG='configs/tiny.py', WORKDIR='/w', MTP_DIR=str(ROOT), SLURM_JOB_ID='4242')
  batch = subprocess.Popen(['bash', str(SCRIPT), '--config.num_train_steps=9'], env=env,
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while not ready.exists():
    assert batch.poll() is None and time.monotonic() < deadline, batch.communicate()
    time.sleep(0.05)
  batch.send_signal(signal.SIGUSR1)  # --signal=B:USR1: the batch shell alone gets it.
  _, err = batch.communicate(timeout=60)
  assert batch.returncode == exit_code, err
  expected = [
      'srun --kill-on-bad-exit=1 python3 -m launch.train --config=configs/tiny.py --workdir=/w '
      '--num_processes=-1 --heartbeat_timeout_s=100 --config.num_train_steps=9',
      'task saved on SIGUSR1']
  if requeued:  # Only after the task has saved and ended.
    expected.append('scontrol requeue 4242')
  assert calls.read_text().splitlines() == expected, err
  assert 'SIGUSR1, the time limit is near' in err
  assert ('requeueing job 4242' in err) == requeued


@pytest.mark.slow
def test_two_tasks_train_through_slurm_auto_detection(tmp_path):
  # srun's part: one process per task, each with the variables SLURM gives a task.
  env = _fake_srun(tmp_path, '''
      import os, subprocess, sys
      args = sys.argv[1:]
      while args[0].startswith('-'):
        args.pop(0)
      n = int(os.environ['SLURM_NTASKS'])
      tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i),
                                                SLURM_LOCALID=str(i))) for i in range(n)]
      sys.exit(max(abs(t.wait()) for t in tasks))''')
  env.update(CONFIG='configs/tiny.py', WORKDIR=str(tmp_path / 'run'), MTP_DIR=str(ROOT),
             PYTHON=sys.executable, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu',
             SLURM_JOB_ID='4242', SLURM_NTASKS='2', SLURM_STEP_NODELIST='localhost',
             SLURM_JOB_NODELIST='localhost', JAX_COORDINATOR_PORT=str(multiprocess.free_port()))
  done = _sbatch(env, '--config.num_train_steps=2', '--config.log_every_steps=1',
                 '--config.eval_steps=0')
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Process 1 of 2.' in done.stderr and 'Process 0 of 2.' in done.stderr
  records = [r for r in writers.read_metrics(tmp_path / 'run') if 'loss' in r]
  assert [r['step'] for r in records] == [1, 2]
