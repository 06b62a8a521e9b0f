"""Workdir files on an object store: `gs://` on a local Cloud Storage emulator (`gcs_bucket`).

The workdir's own files (config.json, base.json, the tokenizer, metrics.jsonl, the lock) go
through etils.epath and gcsfs. Nothing may land on the local disk under a mangled name
(`gs:/bucket/...`, what pathlib makes of a URL). Checkpoints, data, exports and whole runs on
`gs://` are tested end to end in tests/gcs_test.py.
"""

import json
import os

import pytest
from etils import epath

from configs import tiny
from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.checkpoint import workdir_lock
from mtp.data import tokenizer as tokenizer_lib
from mtp.train import workdir_tokenizer
from mtp.train import writers


@pytest.fixture
def bucket(gcs_bucket, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)  # Where a mangled local `gs:/...` directory would appear.
  yield gcs_bucket
  assert not (tmp_path / 'gs:').exists()
  assert not os.listdir(tmp_path), os.listdir(tmp_path)


def _stored(name):
  return epath.Path(name).is_file()


def test_config_and_base_reference_on_a_bucket(bucket):
  heads, base = f'{bucket}/heads', f'{bucket}/base'
  config = tiny.get_config()
  checkpointing.save_config(base, config)
  assert _stored(f'{base}/config.json')
  assert checkpointing.load_config(base).model.embed_dim == config.model.embed_dim
  checkpointing.write_base_reference(heads, base)
  assert str(checkpointing.base_reference(heads)) == base


def test_metrics_on_a_bucket_are_rewritten_whole_and_resume(bucket):
  workdir = f'{bucket}/run'
  writer = writers.MetricWriter(workdir, show_progress=False)
  for step in (1, 2, 3):
    writer.write({'step': step, 'loss': float(step)})
  writer.close()
  assert [r['step'] for r in writers.read_metrics(workdir)] == [1, 2, 3]
  # A run resumed from step 2 drops the records logged after it.
  writer = writers.MetricWriter(workdir, resume_from_step=2, show_progress=False)
  writer.write({'step': 3, 'loss': 30.0})
  writer.close()
  assert [r['loss'] for r in writers.read_metrics(workdir)] == [1.0, 2.0, 30.0]


def test_tokenizer_is_built_saved_adopted_and_loaded_on_a_bucket(bucket):
  config = tiny.get_config()
  built = workdir_tokenizer.prepare(config, f'{bucket}/run')
  assert _stored(f'{bucket}/run/{tokenizer_lib.FILENAME}')
  workdir_tokenizer.adopt(f'{bucket}/run', f'{bucket}/heads')
  loaded = tokenizer_lib.Tokenizer.load(epath.Path(f'{bucket}/heads'))
  assert list(loaded.encode('def f(): pass')) == list(built.encode('def f(): pass'))


def test_workdir_lock_on_a_bucket_is_a_marker_that_refuses_a_second_writer(bucket):
  workdir = f'{bucket}/run'
  with workdir_lock.WorkdirLock(workdir):
    assert _stored(f'{workdir}.lock')
    with pytest.raises(workdir_lock.WorkdirLockedError, match='is in use by pid'):
      workdir_lock.WorkdirLock(workdir).acquire()
  assert not _stored(f'{workdir}.lock')


def test_local_caches_of_a_bucket_workdir_live_on_this_host(bucket, monkeypatch, tmp_path):
  # Under the host's one cache directory ($MTP_CACHE_DIR; MTP_LOCAL_CACHE is gone), in workdirs/.
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path.parent / 'cache'))
  local = paths.local_dir(f'{bucket}/run', 'data_cache')
  assert not paths.is_url(local)
  assert str(local) == str(tmp_path.parent / 'cache' / 'workdirs' / 'gs' /
                           bucket.removeprefix('gs://') / 'run' / 'data_cache')
  assert str(paths.local_dir(tmp_path / 'run', 'data_cache')) == str(tmp_path / 'run' /
                                                                    'data_cache')


def test_of_two_racing_writers_on_a_bucket_the_overwritten_one_gives_way(bucket, monkeypatch):
  workdir = f'{bucket}/run'
  path_type = type(epath.Path(workdir))
  write_text = path_type.write_text

  def raced(self, text, *args, **kwargs):  # Another host writes its record just after ours.
    write_text(self, text, *args, **kwargs)
    write_text(self, json.dumps({'pid': 7, 'host': 'other-host', 'since': 'now'}))
  monkeypatch.setattr(path_type, 'write_text', raced)
  with pytest.raises(workdir_lock.WorkdirLockedError, match="pid 7 on host 'other-host'"):
    workdir_lock.WorkdirLock(workdir).acquire()


def test_threads_fetching_one_file_at_once_share_one_whole_copy(bucket, monkeypatch, tmp_path):
  """The data loader's threads fetch a shard's files together: each gets the whole copy (a
  temporary file per thread, not per process, or one thread renames another's away)."""
  from concurrent import futures  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path.parent / 'cache'))
  data = os.urandom(1 << 20)
  url = f'{bucket}/shard.bin'
  epath.Path(url).write_bytes(data)
  with futures.ThreadPoolExecutor(8) as pool:
    copies = list(pool.map(lambda _: paths.local_copy(url), range(16)))
  assert len(set(copies)) == 1 and copies[0].read_bytes() == data
  assert not [p for p in copies[0].parent.iterdir() if p.name.endswith(('.part', '.tmp'))]
