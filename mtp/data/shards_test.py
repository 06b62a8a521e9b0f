"""Tests for mtp.data.shards: writing, random access, and the checks of a dataset directory."""

import json

import numpy as np
import pytest

from mtp.data import shards
from mtp.data import tokenizer as tokenizer_lib


def _docs(count, seed=0):
  rng = np.random.default_rng(seed)
  return [np.append(rng.integers(3, 259, size=rng.integers(0, 40)), 1).astype(np.int32)
          for _ in range(count)]


def _write(directory, docs, shard_tokens=100, record_tokens=16):
  writer = shards.SplitWriter(directory, 'train', np.dtype(np.uint16), shard_tokens,
                              record_tokens)
  for doc in docs:
    writer.add(doc)
  entry = writer.close()
  tok = tokenizer_lib.byte_tokenizer()
  tok.save(directory)
  manifest = {'format': shards.FORMAT, 'version': shards.VERSION, 'token_dtype': 'uint16',
              'record_tokens': record_tokens,
              'tokenizer': {'sha256': shards.tokenizer_hash(tok)},
              'splits': {'train': entry, 'valid': {'num_documents': 0, 'num_tokens': 0,
                                                   'shards': []}}}
  (directory / shards.MANIFEST_FILENAME).write_text(json.dumps(manifest))
  return entry


def test_any_token_range_reads_back(tmp_path):
  docs = _docs(60)
  entry = _write(tmp_path, docs)
  assert len(entry['shards']) > 2  # Ranges cross shards and records.
  assert all(s['num_tokens'] >= 100 for s in entry['shards'][:-1])
  flat = np.concatenate(docs)
  starts = np.cumsum([0] + [len(d) for d in docs])
  reader = shards.open_dataset(tmp_path).split('train')
  assert (reader.num_tokens, reader.num_documents) == (len(flat), len(docs))
  rng = np.random.default_rng(1)
  for _ in range(200):
    start = int(rng.integers(0, len(flat)))
    stop = int(rng.integers(start, min(len(flat), start + 150) + 1))
    pieces = reader.pieces(start, stop)
    np.testing.assert_array_equal(np.concatenate(pieces) if pieces else [], flat[start:stop])
    # Pieces split exactly at the document starts inside the range.
    inside = [s for s in starts if start < s < stop]
    assert np.cumsum([len(p) for p in pieces])[:-1].tolist() == [s - start for s in inside]
  for got, want in zip(reader.documents(), docs, strict=True):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(IndexError):
    reader.pieces(0, len(flat) + 1)


def test_a_reader_pickles_without_open_files(tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top
  _write(tmp_path, _docs(10))
  reader = shards.open_dataset(tmp_path).split('train')
  want = reader.pieces(3, 50)
  copy = pickle.loads(pickle.dumps(reader))
  np.testing.assert_array_equal(np.concatenate(copy.pieces(3, 50)), np.concatenate(want))


def test_a_url_of_an_unsupported_scheme_is_refused_by_name(tmp_path, monkeypatch):
  """gs:// datasets are read from the bucket (tests/gcs_test.py); other schemes are named,
  never folded into a local path."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(shards.DatasetError, match=r'^--data=s3://b/t: s3:// paths are not '
                                                r'supported \(use a local path or gs://\)'):
    shards.open_dataset('s3://b/t', what='--data')
  assert not list(tmp_path.iterdir())


def test_bad_dataset_directories_are_named(tmp_path):
  with pytest.raises(shards.DatasetError, match='does not exist'):
    shards.open_dataset(tmp_path / 'missing')
  with pytest.raises(shards.DatasetError, match='manifest.json is missing'):
    shards.open_dataset(tmp_path)
  entry = _write(tmp_path, _docs(10))
  (tmp_path / entry['shards'][0]['records']).unlink()
  with pytest.raises(shards.DatasetError, match=r'00000.array_record is missing'):
    shards.open_dataset(tmp_path)
  manifest = json.loads((tmp_path / shards.MANIFEST_FILENAME).read_text())
  manifest['splits']['train']['shards'] = []
  (tmp_path / shards.MANIFEST_FILENAME).write_text(json.dumps(manifest))
  with pytest.raises(shards.DatasetError, match=r'train holds no shard'):
    shards.open_dataset(tmp_path)
  (tmp_path / shards.MANIFEST_FILENAME).write_text('{"format": "other"}')
  with pytest.raises(shards.DatasetError, match='not a readable manifest'):
    shards.open_dataset(tmp_path)


def test_an_empty_split_is_named_when_read(tmp_path):
  _write(tmp_path, _docs(5))
  with pytest.raises(shards.DatasetError, match="has no 'valid' documents"):
    shards.open_dataset(tmp_path).split('valid')
