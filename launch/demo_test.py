"""`python -m launch.demo` as the README runs it, on the tiny config: train, evaluate on
held-out code, plot, and decode with each decoder (the demo exits 1 if their outputs differ)."""

import os
import re
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import flagsaver
import pytest

from launch import cli
from launch import demo
from mtp.checkpoint import workdir_lock
from mtp.train import divergence
from mtp.train import preemption
from mtp.train import trainer


def test_the_demo_runs_end_to_end_on_a_tiny_config(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)  # One device, as a user's machine.
  env['MTP_CACHE_DIR'] = str(tmp_path / 'cache')  # 'auto' measures its break-even there.
  env.setdefault('JAX_COMPILATION_CACHE_DIR',
                 os.path.join(tempfile.gettempdir(), 'mtp-test-jax-cache'))
  run = subprocess.run(
      [sys.executable, '-m', 'launch.demo', '--config=configs/tiny.py',
       f'--workdir={tmp_path / "wd"}', '--config.num_train_steps=2', '--config.eval_steps=0',
       '--heldout_batches=1', '--decode_prompts=2', '--decode_tokens=8'],
      env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'Held-out code' in run.stdout
  for decoder in ('speculative', 'auto'):
    assert re.search(rf'{decoder} .* outputs matched: yes \(2/2 prompts\)', run.stdout), (
        run.stdout[-2000:])
  assert (tmp_path / 'wd' / 'learning_curve.png').stat().st_size > 0


@pytest.mark.parametrize('error,code', [
    (preemption.Preempted(4), cli.PREEMPTED),
    (divergence.DivergenceError('Training diverged at step 7 (loss nan)', 7), cli.DIVERGED),
    (workdir_lock.WorkdirLockedError('/w is in use by pid 7 on h (lock /w.lock)'), cli.ERROR),
    (ValueError('keep_checkpoints must be at least 1, got 0'), cli.ERROR),
])
@flagsaver.flagsaver
def test_a_failed_training_is_one_line_and_the_launchers_exit_code(tmp_path, monkeypatch, capsys,
                                                                   error, code):
  def fails(config, workdir):
    raise error
  monkeypatch.setattr(trainer, 'train_and_evaluate', fails)
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['demo', '--config=configs/tiny.py', f'--workdir={tmp_path}'])
  with pytest.raises(SystemExit) as e:
    demo.main(['demo'])
  line = f'launch.demo: {error}'
  if code == cli.ERROR:
    assert e.value.code == line
  else:
    assert e.value.code == code and capsys.readouterr().err.strip() == line
