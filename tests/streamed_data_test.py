"""Training on a dataset that launch.prepare_data wrote (--config.data.source): it streams,
evaluates on the valid split, resumes exactly, and refuses a bad source before compiling."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from mtp.data import prepare
from mtp.data import shards
from mtp.data import streaming
from mtp.data import tokenizer as tokenizer_lib
from mtp.train import testing
from mtp.train import trainer
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train(workdir, source, stop_after_step=None):
  config = testing.tiny_config(**{
      'data.source': str(source), 'num_train_steps': 4, 'log_every_steps': 1,
      'eval_steps': 1, 'eval_every_steps': 2, 'checkpoint_every_steps': 2})
  return trainer.train_and_evaluate(config, workdir, stop_after_step=stop_after_step)


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  root = tmp_path_factory.mktemp('streamed')
  rng = np.random.default_rng(0)
  lines = [json.dumps({'text': f'def f{i}(x):\n' + '    x += 1\n' * int(rng.integers(0, 30))})
           for i in range(200)]
  (root / 'code.jsonl').write_text('\n'.join(lines) + '\n')
  prepare.prepare(str(root / 'code.jsonl'), root / 'ds', num_workers=1, valid_fraction=0.1,
                  shard_tokens=3000)
  return root / 'ds'


def test_training_streams_the_dataset_and_resumes_exactly(dataset, tmp_path):
  _train(tmp_path / 'whole', dataset)
  _train(tmp_path / 'halves', dataset, stop_after_step=2)
  _train(tmp_path / 'halves', dataset)  # Resumes at step 2.
  whole, halves = (writers.read_metrics(tmp_path / w) for w in ('whole', 'halves'))
  losses = [[r['loss'] for r in m if 'loss' in r] for m in (whole, halves)]
  assert len(losses[0]) == 4
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  assert [r['step'] for r in whole if 'eval_loss' in r] == [2, 4]
  assert (tokenizer_lib.Tokenizer.load(tmp_path / 'whole').to_json()
          == tokenizer_lib.Tokenizer.load(dataset).to_json())
  assert not (tmp_path / 'whole' / 'data_cache').exists()


def test_bad_sources_fail_before_training(dataset, tmp_path):
  with pytest.raises(shards.DatasetError,
                     match=r'^config\.data\.source=.*missing: the dataset directory does not'):
    _train(tmp_path / 'w', tmp_path / 'missing')
  workdir = tmp_path / 'bpe_workdir'
  tokenizer_lib.train_bpe(['def f(x): return x'] * 50, 262).save(workdir)
  with pytest.raises(streaming.TokenizerMismatchError,
                     match=r'was tokenized with another tokenizer \(byte, 259 ids\) than the '
                           r'one in .*bpe_workdir \(bpe'):
    _train(workdir, dataset)
  assert not (workdir / 'config.json').exists()  # Nothing ran.


def test_the_command_names_a_missing_manifest(dataset, tmp_path):
  (tmp_path / 'empty').mkdir()
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.train', '--config=configs/tiny.py',
       f'--workdir={tmp_path / "w"}', f'--config.data.source={tmp_path / "empty"}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      f'launch.train: {tmp_path / "empty" / "manifest.json"} is missing: {tmp_path / "empty"} '
      'is not a prepared dataset (or its preparation did not finish).')
