"""Bad input for heads on a pretrained base (`init_from`): a base of another trunk shape, or a
prepared dataset (`data.source`) of another tokenizer than the base's, fails with one error
naming the mismatch before anything is written, tokenized, compiled or cached.

The base workdirs here hold only config.json and tokenizer.json: the checks read nothing else.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mtp.checkpoint import checkpointing
from mtp.data import prepare
from mtp.data import tokenizer as tokenizer_lib
from mtp.train import config_checks
from mtp.train import testing
from mtp.train import trainer as trainer_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _base(path, tokenizer=None, **overrides):
  """A base workdir `path`: configs/tiny.py's config.json (with `overrides`) and `tokenizer`
  (default: bytes)."""
  path.mkdir(parents=True)
  checkpointing.save_config(path, testing.tiny_config(**overrides))
  (tokenizer or tokenizer_lib.byte_tokenizer()).save(path)
  return path


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  """A prepared dataset of byte tokens."""
  root = tmp_path_factory.mktemp('ds')
  lines = [json.dumps({'text': f'def f{i}(x):\n    return x + {i}\n'}) for i in range(40)]
  (root / 'code.jsonl').write_text('\n'.join(lines) + '\n')
  prepare.prepare(str(root / 'code.jsonl'), root / 'ds', num_workers=1, valid_fraction=0.1)
  return root / 'ds'


@pytest.fixture
def nothing_runs(monkeypatch):
  """Adopting a tokenizer, tokenizing and building the trainer (compiling) fail the test."""
  def fail(*args, **kwargs):
    del args, kwargs
    pytest.fail('training went past the init_from checks')
  monkeypatch.setattr(trainer_lib.workdir_tokenizer, 'adopt', fail)
  monkeypatch.setattr(trainer_lib.pipeline, 'load_or_build_split', fail)
  monkeypatch.setattr(trainer_lib.step_lib, 'Trainer', fail)


@pytest.mark.parametrize('overrides,named', [
    ({'model.num_layers': 3}, r'model\.num_layers: 2 there, 3 configured\.$'),
    ({'model.vocab_size': 272, 'model.embed_dim': 32},
     r'model\.vocab_size: 264 there, 272 configured; model\.embed_dim: 64 there, 32 configured'),
    ({'model.num_kv_heads': 4}, r'model\.num_kv_heads: 2 there, 4 configured')],
    ids=['num_layers', 'vocab_and_width', 'kv_heads'])
def test_a_base_of_another_trunk_fails_before_anything_runs(tmp_path, nothing_runs, overrides,
                                                            named):
  base = _base(tmp_path / 'base')
  config = testing.tiny_config(**{'init_from': str(base), 'optim.mode': 'frozen_trunk',
                                  **overrides})
  with pytest.raises(ValueError, match=rf'^init_from: the trunk in .*base does not match the '
                                       rf'configured trunk: {named}'):
    trainer_lib.train_and_evaluate(config, tmp_path / 'w')
  assert not list((tmp_path / 'w').iterdir())  # Neither config.json nor a tokenizer.


def test_a_dataset_of_another_tokenizer_than_the_base_fails_before_anything_runs(
    tmp_path, dataset, nothing_runs):
  bpe = tokenizer_lib.train_bpe(['def f(x): return x'] * 50, 262)
  base = _base(tmp_path / 'base', bpe)
  config = testing.tiny_config(**{'init_from': str(base), 'data.source': str(dataset),
                                  'optim.mode': 'frozen_trunk'})
  with pytest.raises(ValueError, match=r'^The dataset data\.source=.*ds was tokenized with another '
                                       r'tokenizer \(byte, 259 ids\) than the base workdir '
                                       r'init_from=.*base \(bpe, 262 ids\): prepare the data '
                                       r'with --tokenizer=.*base\.$'):
    trainer_lib.train_and_evaluate(config, tmp_path / 'w')
  assert not list((tmp_path / 'w').iterdir())


def test_a_matching_base_passes(tmp_path, dataset):
  """Runtime settings may differ, and floats agree to float32 precision (a GGUF's epsilon)."""
  base = _base(tmp_path / 'base', **{'model.norm_eps': 9.9999997e-06})
  config_checks.check_init_from(testing.tiny_config(**{
      'init_from': str(base), 'data.source': str(dataset), 'model.remat': 'heads',
      'model.scan_layers': True, 'model.mtp_head_type': 'eagle', 'model.mtp_num_heads': 1}))
  config_checks.check_init_from(testing.tiny_config())  # No base: nothing to check.
  with pytest.raises(checkpointing.CheckpointError, match=r'config\.json does not exist'):
    config_checks.check_init_from(testing.tiny_config(init_from=str(tmp_path / 'none')))
  (base / tokenizer_lib.FILENAME).unlink()
  with pytest.raises(checkpointing.CheckpointError,
                     match=r'^init_from: .*base/tokenizer\.json does not exist\.$'):
    config_checks.check_init_from(testing.tiny_config(init_from=str(base),
                                                      **{'data.source': str(dataset)}))


def test_a_resumed_workdir_is_not_checked_against_its_base_again(tmp_path):
  """Its config was checked when it started; a full fine-tune no longer reads the base."""
  config = testing.tiny_config(init_from=str(tmp_path / 'deleted_base'))
  checkpointing.save_config(tmp_path, config)
  config_checks.check_workdir_matches(tmp_path, config)


def test_the_command_names_the_mismatch_in_one_line(tmp_path):
  base = _base(tmp_path / 'base')
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.train', '--config=configs/tiny.py',
       f'--workdir={tmp_path / "w"}', f'--config.init_from={base}',
       '--config.model.num_layers=3'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f'launch.train: init_from: the trunk in {base} does not match the configured trunk: '
      'model.num_layers: 2 there, 3 configured.')
  assert not (tmp_path / 'w' / checkpointing.CONFIG_FILENAME).exists()
