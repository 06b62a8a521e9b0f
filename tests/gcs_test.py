"""Runs on Cloud Storage end to end: `gs://` workdirs, datasets and trunk caches on a local
emulator (`gcs_bucket`, tests/gcs_emulator.py), through the real clients: gcsfs under
etils.epath, tensorstore under Orbax.

  * A dataset prepared onto a bucket reads token for token as the same dataset prepared
    locally; its manifest lands last, and a bucket directory without one is no dataset.
  * Training on a bucket (workdir and data both there) stops on SIGTERM with a checkpoint on
    the bucket and exit code 143, and the resumed run's losses and final parameters equal an
    uninterrupted local run's, bit for bit.
  * Heads trained on a frozen trunk that lives on a bucket keep their trunk cache in the
    bucket workdir: a host without it fetches it instead of running the trunk again.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

from etils import epath
from flax import nnx
import jax
import numpy as np
import pytest

from launch import cli
import mtp
from mtp import testing as mtp_testing
from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.data import prepare
from mtp.data import shards
from mtp.train import trainer as trainer_lib
from mtp.train import trainer_test
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / 'configs' / 'tiny.py')


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A small local source tree: a few of the standard library's json modules."""
  source = tmp_path_factory.mktemp('corpus')
  for path in sorted(pathlib.Path(json_dir()).glob('*.py')):
    shutil.copy(path, source / path.name)
  return source


def json_dir() -> str:
  import json  # pylint: disable=import-outside-toplevel
  return os.path.dirname(json.__file__)


def _prepare(corpus, output, **kwargs):
  return prepare.prepare(str(corpus), output, num_workers=1, shard_tokens=20_000,
                         record_tokens=512, **kwargs)


def test_a_dataset_prepared_on_a_bucket_reads_as_the_local_one(corpus, gcs_bucket, tmp_path,
                                                               monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  remote = f'{gcs_bucket}/tokens'
  _prepare(corpus, tmp_path / 'tokens')
  manifest = _prepare(corpus, remote)
  assert manifest['num_tokens'] > 40_000 and len(manifest['splits']['train']['shards']) > 1
  assert not (tmp_path / 'cache' / 'workdirs').exists() or not any(
      (tmp_path / 'cache' / 'workdirs').rglob('*.array_record'))  # Staging removed.
  local, bucket = shards.open_dataset(tmp_path / 'tokens'), shards.open_dataset(remote)
  assert isinstance(bucket.directory, epath.Path) and paths.is_url(bucket.directory)
  assert bucket.tokenizer_hash == local.tokenizer_hash
  for split in shards.SPLITS:
    want, got = local.split(split), bucket.split(split)
    assert got.num_tokens == want.num_tokens
    n = want.num_tokens
    for start, stop in ((0, n), (n // 3, 2 * n // 3 + 5), (n - 3, n)):
      for a, b in zip(got.pieces(start, stop), want.pieces(start, stop), strict=True):
        np.testing.assert_array_equal(a, b)
  # Read through this host's copies of the shards, fetched on first use.
  assert sorted(p.name for p in (tmp_path / 'cache' / 'remote').rglob('*.array_record'))

  with pytest.raises(prepare.PrepareError, match='already exists'):
    _prepare(corpus, remote)
  _prepare(corpus, remote, overwrite=True, valid_fraction=0.0)
  assert shards.open_dataset(remote).manifest['valid_fraction'] == 0.0
  # The manifest is what makes a dataset: without it (an upload cut short) there is none.
  epath.Path(f'{remote}/{shards.MANIFEST_FILENAME}').unlink()
  with pytest.raises(shards.DatasetError, match='manifest.json is missing'):
    shards.open_dataset(remote)
  with pytest.raises(shards.DatasetError, match='does not exist'):
    shards.open_dataset(f'{gcs_bucket}/nothing-here')


def test_a_url_source_is_refused_by_name(gcs_bucket, tmp_path):
  with pytest.raises(ValueError, match=r'--source=gs://.*not supported here'):
    prepare.prepare(f'{gcs_bucket}/texts', tmp_path / 'out')
  assert not (tmp_path / 'out').exists()


def _train(workdir, *flags: str) -> subprocess.Popen:
  env = mtp_testing.child_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  env.pop('MTP_TRACEBACK', None)
  return subprocess.Popen(
      [sys.executable, '-m', 'launch.train', f'--config={TINY}', f'--workdir={workdir}',
       '--config.log_every_steps=1', '--config.eval_steps=0',
       '--config.checkpoint_every_steps=1000', *flags],
      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(workdir):
  return {r['step']: r['loss'] for r in writers.read_metrics(workdir) if 'loss' in r}


@pytest.mark.slow
def test_training_on_a_bucket_stops_on_sigterm_and_resumes_exactly(corpus, gcs_bucket,
                                                                   tmp_path):
  seed = random.randrange(1 << 30)
  num_steps = 16
  data = f'{gcs_bucket}/tokens'
  _prepare(corpus, data)
  common = (f'--config.num_train_steps={num_steps}', f'--config.data.source={data}')
  straight = _train(tmp_path / 'straight', *common)
  out = straight.communicate(timeout=600)[0]
  assert straight.returncode == 0, out[-3000:]

  workdir = f'{gcs_bucket}/run'
  run = _train(workdir, *common)
  at_step = random.Random(seed).randint(2, 8)
  deadline = time.monotonic() + 300
  while not any(step >= at_step for step in _losses(workdir)):
    assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-3000:]
    time.sleep(0.1)
  run.send_signal(signal.SIGTERM)
  out = run.communicate(timeout=300)[0]
  context = f'seed {seed}, SIGTERM at step {at_step}'
  assert run.returncode == cli.PREEMPTED, (context, out[-3000:])
  saved = checkpointing.Checkpointer(workdir, read_only=True).latest_step()
  assert at_step <= saved < num_steps, (context, saved)
  assert epath.Path(f'{workdir}/checkpoints/{saved}').is_dir()

  resumed = _train(workdir, *common)
  out = resumed.communicate(timeout=600)[0]
  assert resumed.returncode == 0, (context, out[-3000:])
  assert _losses(workdir) == _losses(tmp_path / 'straight'), context
  straight_model, resumed_model = mtp.load(tmp_path / 'straight'), mtp.load(workdir)
  assert resumed_model.step == straight_model.step == num_steps, context
  want = jax.tree.leaves(nnx.state(straight_model.model))
  got = jax.tree.leaves(nnx.state(resumed_model.model))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=context)


def test_heads_on_a_trunk_in_a_bucket_keep_their_trunk_cache_there(tiny_workdir, gcs_bucket,
                                                                   tmp_path, monkeypatch):
  source = f'{gcs_bucket}/trunk'
  paths.upload_tree(tiny_workdir, source)
  workdir = f'{gcs_bucket}/heads'
  config = trainer_test._config(**{  # pylint: disable=protected-access
      'init_from': source, 'optim.mode': 'frozen_trunk', 'model.mtp_num_heads': 2,
      'num_train_steps': 2, 'log_every_steps': 1, 'eval_steps': 0,
      'data.max_corpus_bytes': 60_000, 'distill.cache_trunk_states': True})
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'host_a'))
  trainer_lib.train_and_evaluate(config, workdir)
  [kept] = list(epath.Path(f'{workdir}/trunk_cache').iterdir())
  assert sorted(p.name for p in kept.iterdir()) == ['targets.npy', 'trunk_hidden.npy']
  built = np.load(next((tmp_path / 'host_a').rglob('trunk_cache/*/trunk_hidden.npy')))

  # Another host, without the local copy, resumes: it fetches the cache, runs no trunk pass.
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'host_b'))
  config.num_train_steps = 3
  with monkeypatch.context() as m:
    m.setattr('mtp.train.trunk_cache.build', _no_trunk_pass)
    trainer_lib.train_and_evaluate(config, workdir)
  [fetched] = list((tmp_path / 'host_b' / 'remote').rglob('trunk_hidden.npy'))
  np.testing.assert_array_equal(np.load(fetched), built)
  assert sorted(_losses(workdir)) == [1, 2, 3]


def _no_trunk_pass(*args, **kwargs):
  raise AssertionError('the trunk cache was built again instead of fetched from the workdir')


def test_measurements_are_shared_on_a_bucket_and_host_caches_stay_local(tiny_workdir, gcs_bucket,
                                                                        tmp_path, monkeypatch):
  """MTP_CACHE_DIR=gs://...: decoding's measurements (break-evens, the corpus's token counts)
  go to the bucket and are read back by the next load (a fresh measurement is an error here);
  nothing is folded into a local `gs:` directory."""
  monkeypatch.setenv('MTP_CACHE_DIR', f'{gcs_bucket}/cache')
  monkeypatch.chdir(tmp_path)
  model = mtp.load(tiny_workdir)
  prompts = ['def f(x):', 'import os\n']
  first = mtp.generate(model, prompts, max_new_tokens=8, decoder='auto', draft_vocab=64)
  tables = sorted(p.name for p in epath.Path(f'{gcs_bucket}/cache/decode').iterdir())
  assert 'break_even.json' in tables and 'token_counts' in tables, tables
  with monkeypatch.context() as m:
    m.setattr('mtp.decode.measurements.store', _no_measuring)
    m.setattr('mtp.decode.measurements.write_array', _no_measuring)
    again = mtp.generate(mtp.load(tiny_workdir), prompts, max_new_tokens=8, decoder='auto',
                         draft_vocab=64)
  assert [g.tokens for g in again] == [g.tokens for g in first]
  assert not (tmp_path / 'gs:').exists()


def _no_measuring(*args, **kwargs):
  raise AssertionError('measured again instead of reading the measurement on the bucket')
