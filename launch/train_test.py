"""launch.train's failures: one line and an exit code per kind (launch/cli.py), preemption (SIGTERM,
SIGUSR1) too."""

import pathlib
import signal
import subprocess
import sys
import time

import pytest
from absl import flags
from absl.testing import flagsaver

from launch import cli
from launch import train
from mtp import testing as mtp_testing
from mtp.checkpoint import checkpointing
from mtp.train import divergence
from mtp.train import preemption
from mtp.train import trainer

FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / 'configs' / 'tiny.py')


def _main(workdir, *extra):
  FLAGS.unparse_flags()
  FLAGS(['train', f'--config={TINY}', f'--workdir={workdir}', *extra])
  train.main(['train'])


@pytest.fixture
def logged(monkeypatch):
  lines = []
  monkeypatch.setattr(train.logging, 'info', lambda fmt, *args: lines.append(fmt % args))
  return lines


@pytest.mark.parametrize('error,code', [
    (preemption.Preempted(4), cli.PREEMPTED),
    (divergence.DivergenceError('Training diverged at step 7 (loss nan)', 7), cli.DIVERGED),
    (ValueError('keep_checkpoints must be at least 1, got 0'), cli.ERROR),
    (checkpointing.CheckpointError('Checkpoint /w/checkpoints/2 could not be restored'),
     cli.ERROR),
    (KeyError('model'), cli.ERROR),
])
@flagsaver.flagsaver
def test_each_failure_is_one_line_and_its_exit_code(tmp_path, monkeypatch, capsys, logged,
                                                    error, code):
  def fails(config, workdir):
    raise error
  monkeypatch.setattr(trainer, 'train_and_evaluate', fails)
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  with pytest.raises(SystemExit) as e:
    _main(tmp_path)
  line = f'launch.train: {error.args[0] if isinstance(error, KeyError) else error}'
  if code == cli.ERROR:
    assert e.value.code == line
  else:
    assert e.value.code == code
    assert capsys.readouterr().err.strip() == line
  assert not any('Final metrics' in x for x in logged)


@flagsaver.flagsaver
def test_the_traceback_with_the_env_var(tmp_path, monkeypatch, capsys):
  def fails(config, workdir):
    raise ValueError('bad value')
  monkeypatch.setattr(trainer, 'train_and_evaluate', fails)
  monkeypatch.setenv('MTP_TRACEBACK', '1')
  with pytest.raises(SystemExit, match='launch.train: bad value'):
    _main(tmp_path)
  assert 'Traceback' in capsys.readouterr().err


def _launch(workdir, *extra, **kwargs):
  env = mtp_testing.child_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('MTP_TRACEBACK', None)
  return subprocess.Popen([sys.executable, '-m', 'launch.train', f'--config={TINY}',
                           f'--workdir={workdir}', *extra], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_unknown_config_key_is_a_usage_error(tmp_path):
  proc = _launch(tmp_path / 'w', '--config.num_train_step=5')
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == cli.USAGE
  assert err.strip().splitlines()[-1] == (
      "launch.train: unknown config key 'num_train_step' in a --config.* flag (Did you mean "
      '"num_train_steps" instead of "num_train_step"?); configs/base.py documents every key')
  assert 'Traceback' not in err and not (tmp_path / 'w').exists()


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_saves_then_exits_with_the_preemption_code(tmp_path, signum):
  workdir = tmp_path / 'w'
  proc = _launch(workdir, '--config.num_train_steps=100000', '--config.log_every_steps=1',
                 '--config.eval_steps=0')
  metrics = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while not (metrics.exists() and metrics.read_text().strip()):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    time.sleep(0.2)
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == cli.PREEMPTED, err[-3000:]
  assert 'Final metrics' not in err
  assert f'launch.train: preempted ({signum.name}): saved a checkpoint at step' in err
  assert checkpointing.Checkpointer(workdir, read_only=True).all_steps()
  assert not (tmp_path / 'w.lock').exists()


class _Joined(Exception):
  """Raised by a stand-in for jax.distributed.initialize: the test ends there."""


@pytest.mark.parametrize('extra, expected_args', [
    (['--num_processes=-1', '--heartbeat_timeout_s=7'], ()),
    (['--num_processes=2', '--process_id=1', '--coordinator_address=h:9'], ('h:9', 2, 1)),
])
@flagsaver.flagsaver
def test_a_multi_host_run_joins_with_the_heartbeat_timeout(tmp_path, monkeypatch, extra,
                                                           expected_args):
  import jax  # pylint: disable=g-import-not-at-top
  calls = []

  def initialize(*args, **kwargs):
    calls.append((args, kwargs))
    raise _Joined()
  monkeypatch.setattr(jax.distributed, 'initialize', initialize)
  with pytest.raises(_Joined):
    _main(tmp_path, *extra)
  heartbeat = 7 if '--heartbeat_timeout_s=7' in extra else 100
  assert calls == [(expected_args, {'initialization_timeout': 300,
                                    'heartbeat_timeout_seconds': heartbeat})]


@pytest.mark.parametrize('extra, message', [
    (['--num_processes=0'], 'must be -1'),
    (['--num_processes=2', '--process_id=0'], 'needs --process_id and --coordinator_address'),
])
@flagsaver.flagsaver
def test_bad_process_flags_are_named(tmp_path, capsys, extra, message):
  with pytest.raises(SystemExit) as e:
    _main(tmp_path, *extra)
  assert e.value.code == cli.USAGE
  assert message in capsys.readouterr().err


@pytest.mark.parametrize('flag, value, named', [
    ('--workdir', 's3://b/run', '--workdir=s3://b/run: s3:// paths are not supported (use a '
     'local path or gs://)'),
    ('--config.data.source', 'hdfs://n/tokens',
     'config.data.source=hdfs://n/tokens: hdfs:// paths are not supported'),
    ('--config.init_from', 'az://c/base', 'config.init_from=az://c/base: az:// paths are not'),
])
def test_a_path_nothing_can_serve_is_named_before_jax_starts(tmp_path, flag, value, named):
  """gs:// is served (tests/gcs_test.py); other schemes are refused in one line, before
  anything is written (the workdir is not made) or compiled."""
  workdir = value if flag == '--workdir' else tmp_path / 'w'
  proc = _launch(workdir, *([f'{flag}={value}'] if flag != '--workdir' else []))
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == cli.ERROR, err[-2000:]
  assert err.strip().splitlines()[-1].startswith(f'launch.train: {named}'), err[-2000:]
  assert 'Traceback' not in err and not list(tmp_path.iterdir())
