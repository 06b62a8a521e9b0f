"""The long-context phase: which steps read long rows, exact resume across it, bad values."""

import pytest

from mtp.train import long_context
from mtp.train import step as step_lib
from mtp.train import testing as train_testing
from mtp.train import trainer as trainer_lib
from mtp.train import writers

_PHASE = {'num_train_steps': 6, 'long_context.steps': 2, 'long_context.seq_len': 128,
          'long_context.batch_size': 4, 'log_every_steps': 1, 'eval_steps': 0,
          'checkpoint_every_steps': 100}


def _config(**overrides):
  return train_testing.tiny_config(**{**_PHASE, **overrides})


def _losses(workdir):
  return {r['step']: r['loss'] for r in writers.read_metrics(workdir) if 'loss' in r}


def test_the_last_steps_read_long_rows(tmp_path, monkeypatch):
  shapes = []
  original = step_lib.Trainer.train_batch

  def recording(self, arrays):
    shapes.append(arrays['tokens'].shape)
    return original(self, arrays)

  monkeypatch.setattr(step_lib.Trainer, 'train_batch', recording)
  trainer_lib.train_and_evaluate(_config(), tmp_path)
  assert shapes == [(8, 64)] * 4 + [(4, 128)] * 2
  records = [r for r in writers.read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in records] == list(range(1, 7))
  # The first step of each phase compiles, and is left out of the throughput.
  assert [r['tokens_per_sec'] > 0 for r in records] == [False, True, True, True, False, True]


@pytest.mark.parametrize('stop_after', [4, 5])  # The last short step; the first long one.
def test_resume_across_the_phase_is_exact(tmp_path, stop_after):
  straight = tmp_path / 'straight'
  trainer_lib.train_and_evaluate(_config(), straight)
  interrupted = tmp_path / 'interrupted'
  trainer_lib.train_and_evaluate(_config(), interrupted, stop_after_step=stop_after)
  trainer_lib.train_and_evaluate(_config(), interrupted)
  assert _losses(interrupted) == _losses(straight)


def test_phase_steps():
  config = _config()
  assert long_context.first_step(config) == 5
  assert [long_context.in_phase(config, s) for s in range(1, 7)] == [False] * 4 + [True] * 2
  assert long_context.first_step(_config(**{'long_context.steps': 0})) is None


@pytest.mark.parametrize('overrides,message', [
    ({'long_context.steps': 7}, 'long_context.steps must be between 0 and num_train_steps'),
    ({'long_context.seq_len': 64}, r'long_context.seq_len \(64\) must exceed data.seq_len'),
    ({'long_context.seq_len': 512}, 'exceeds the model\'s maximum sequence length'),
    ({'long_context.batch_size': 0}, 'long_context.batch_size must be at least 1'),
    ({'long_context.batch_size': 3, 'mesh.data': 2}, 'long_context.batch_size'),
    ({'distill.cache_trunk_states': True}, 'long_context trains on rows of another length'),
])
def test_bad_values_are_named_before_compiling(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    trainer_lib.train_and_evaluate(_config(**overrides), tmp_path)
  assert not (tmp_path / 'checkpoints').exists()


def test_a_changed_phase_is_named_on_resume(tmp_path):
  trainer_lib.train_and_evaluate(_config(), tmp_path, stop_after_step=2)
  with pytest.raises(ValueError, match='long_context.seq_len: 128 in the workdir, 192 now'):
    trainer_lib.train_and_evaluate(_config(**{'long_context.seq_len': 192}), tmp_path)
