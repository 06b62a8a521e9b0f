"""Tests for mtp.data.pipeline."""

import json
import os
import pathlib

import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib


def _docs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [np.append(rng.integers(3, 50, size=n - 1), 1).astype(np.int32) for n in lengths]


def _reference_pack(docs, seq_len):
  """Slow reference: row-by-row loops over a padded concatenation."""
  flat = [(tok, d) for d, doc in enumerate(docs) for tok in doc]
  rows = -(-len(flat) // seq_len)
  out = {k: np.zeros([rows, seq_len], np.int32) for k in pipeline.KEYS}
  for r in range(rows):
    seg, pos, prev = 0, 0, None
    for c in range(seq_len):
      i = r * seq_len + c
      if i >= len(flat):
        break
      tok, d = flat[i]
      if d != prev:
        seg, pos, prev = seg + 1, 0, d
      out['tokens'][r, c], out['segment_ids'][r, c], out['positions'][r, c] = tok, seg, pos
      pos += 1
  return out


def _arrays(num_rows, seq_len=4):
  """Rows whose tokens encode the row index, to follow rows through the pipeline."""
  tokens = np.repeat(np.arange(num_rows, dtype=np.int32)[:, None], seq_len, axis=1)
  ones = np.ones_like(tokens)
  return {'tokens': tokens, 'segment_ids': ones,
          'positions': np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape).copy()}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_pack_small_example():
  docs = [np.array(d, np.int32) for d in ([5, 6, 1], [7, 8, 9, 10, 11, 1], [12, 1])]
  out = pipeline.pack(docs, 4)
  np.testing.assert_array_equal(out['tokens'], [[5, 6, 1, 7], [8, 9, 10, 11], [1, 12, 1, 0]])
  np.testing.assert_array_equal(out['segment_ids'], [[1, 1, 1, 2], [1, 1, 1, 1], [1, 2, 2, 0]])
  # The continuation of document 2 restarts at position 0 in each new row.
  np.testing.assert_array_equal(out['positions'], [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 1, 0]])
  dropped = pipeline.pack(docs, 4, drop_remainder=True)
  assert dropped['tokens'].shape == (2, 4)
  for k in pipeline.KEYS:
    assert out[k].dtype == np.int32


@pytest.mark.parametrize('seq_len', [2, 7, 64])
def test_pack_matches_reference(seq_len):
  docs = _docs([1, 3, 70, 5, 64, 1, 200, 9])
  got = pipeline.pack(docs, seq_len)
  want = _reference_pack(docs, seq_len)
  for k in pipeline.KEYS:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # Every document piece that ends a document ends with eos; no padding inside rows.
  tokens, seg = got['tokens'], got['segment_ids']
  ends = np.zeros_like(seg, bool)
  ends[:, :-1] = (seg[:, 1:] != seg[:, :-1]) & (seg[:, :-1] > 0)
  assert (tokens[ends] == 1).all()
  assert (np.diff((seg > 0).astype(int), axis=1) <= 0).all()
  np.testing.assert_array_equal(tokens[seg > 0], np.concatenate(docs))


def test_pack_edge_cases():
  assert pipeline.pack([], 8)['tokens'].shape == (0, 8)
  assert pipeline.pack(_docs([3]), 8)['tokens'].shape == (1, 8)
  with pytest.raises(ValueError, match='seq_len must be at least 2'):
    pipeline.pack(_docs([3]), 1)


def test_tokenize_documents():
  tok = tokenizer_lib.byte_tokenizer()
  texts = ['a = 1\n', '', 'é']
  docs = pipeline.tokenize_documents(texts, tok)
  assert [d[-1] for d in docs] == [tok.eos_id] * 3
  assert [tok.decode(d) for d in docs] == texts
  assert all(d.dtype == np.int32 for d in docs)


@pytest.fixture
def corpus_config(tmp_path) -> ml_collections.ConfigDict:
  root = tmp_path / 'corpus'
  for i in range(40):
    path = root / f'pkg{i % 3}' / f'mod{i}.py'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'def f{i}(x):\n    return x * {i}  # é\n' * (5 + i))
  return ml_collections.ConfigDict({
      'corpus': str(root), 'extensions': ('.py',), 'valid_fraction': 0.2, 'tokenizer': 'byte',
      'seq_len': 32, 'max_corpus_bytes': -1})


def test_load_or_build_split_caches(corpus_config, tmp_path, monkeypatch):
  tok = tokenizer_lib.byte_tokenizer()
  cache = tmp_path / 'cache'
  train = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  valid = pipeline.load_or_build_split(corpus_config, tok, 'valid', cache)
  assert train['tokens'].shape[1] == 32 and valid['tokens'].shape[0] > 0
  texts = pipeline.split_texts(corpus_config, 'train')
  assert (train['segment_ids'] > 0).sum() == sum(len(t.encode()) + 1 for t in texts)
  assert len(list(cache.glob('*.npz'))) == 2

  def fail(*args, **kwargs):
    raise AssertionError('should have been read from the cache')

  monkeypatch.setattr(pipeline, 'tokenize_documents', fail)
  again = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  for k in pipeline.KEYS:
    np.testing.assert_array_equal(again[k], train[k])
  corpus_config.seq_len = 16  # A new key: rebuilt.
  with pytest.raises(AssertionError, match='cache'):
    pipeline.load_or_build_split(corpus_config, tok, 'train', cache)


def test_an_edit_that_keeps_the_size_rebuilds_the_cache(corpus_config, tmp_path):
  tok = tokenizer_lib.byte_tokenizer()
  cache = tmp_path / 'cache'
  before = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  # Same size, same mtime: only the contents tell the edit apart.
  edited = pipeline._split_files(corpus_config, 'train')[0]
  stat = edited.stat()
  text = edited.read_text()
  edited.write_text(text.replace('x * ', 'y * ', 1))
  os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert edited.stat().st_size == stat.st_size
  after = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  assert len(list(cache.glob('train-*.npz'))) == 2
  assert not np.array_equal(after['tokens'], before['tokens'])
  y = tok.encode('y')[0]
  assert (after['tokens'] == y).sum() == (before['tokens'] == y).sum() + 1


@pytest.mark.parametrize('damage', ['truncate', 'garble', 'empty', 'wrong_arrays'])
def test_a_corrupt_cache_file_is_named_and_rebuilt(corpus_config, tmp_path, caplog, damage):
  tok = tokenizer_lib.byte_tokenizer()
  cache = tmp_path / 'cache'
  built = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  [path] = cache.glob('train-*.npz')
  data = path.read_bytes()
  if damage == 'truncate':  # A crash or a full disk mid-write (by a copy, say).
    path.write_bytes(data[:len(data) // 2])
  elif damage == 'garble':
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes(b ^ 0xff for b in data[middle:middle + 64])
                     + data[middle + 64:])
  elif damage == 'empty':
    path.write_bytes(b'')
  else:
    np.savez(path, tokens=np.zeros([3], np.float32))
  with caplog.at_level('WARNING'):
    again = pipeline.load_or_build_split(corpus_config, tok, 'train', cache)
  for k in pipeline.KEYS:
    np.testing.assert_array_equal(again[k], built[k])
  assert any(str(path) in r.message and 'rebuilding' in r.message for r in caplog.records)
  assert [p.name for p in cache.iterdir()] == [path.name]  # Rewritten; no temporary left.
  with np.load(path) as fixed:
    np.testing.assert_array_equal(fixed['tokens'], built['tokens'])


def test_max_corpus_bytes(corpus_config, tmp_path):
  tok = tokenizer_lib.byte_tokenizer()
  corpus_config.max_corpus_bytes = 1000
  texts = pipeline.split_texts(corpus_config, 'train')
  num_bytes = sum(len(t.encode()) for t in texts)
  assert 997 <= num_bytes <= 1000  # a multi-byte character may not fit
  arrays = pipeline.load_or_build_split(corpus_config, tok, 'train', tmp_path / 'cache')
  assert (arrays['segment_ids'] > 0).sum() == num_bytes + len(texts)


def test_a_capped_read_picks_the_same_files_wherever_the_tree_lies(tmp_path):
  """The choice depends on paths below the tree's root only, not on its place or list order."""
  chosen = []
  for root, order in ((tmp_path / 'one', 1), (tmp_path / 'elsewhere' / 'two', -1)):
    files = []
    for i in range(40):
      path = root / f'pkg{i % 4}' / f'module_{i:02d}.py'
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(f'# file {i}\n' + 'x = 1\n' * 20)
      files.append(path)
    texts = pipeline._read_capped(files[::order], 5 * len(files[0].read_bytes()))
    chosen.append([t.splitlines()[0] for t in texts])
  assert chosen[0] == chosen[1] and len(chosen[0]) == 5
  assert chosen[0] != [f'# file {i}' for i in range(5)]  # spread, not the first five


@pytest.mark.parametrize('max_corpus_bytes', [-1, 10**6])
def test_binary_files_are_skipped_and_bad_utf8_reported(corpus_config, caplog,
                                                         max_corpus_bytes):
  root = pathlib.Path(corpus_config.corpus)
  corpus_config.valid_fraction = 0.0
  corpus_config.max_corpus_bytes = max_corpus_bytes
  clean = pipeline.split_texts(corpus_config, 'train')
  (root / 'pkg0' / 'blob.py').write_bytes(b'\x00\x01binary\x00' * 50)
  (root / 'pkg1' / 'latin.py').write_bytes(b'# caf\xe9\n')
  with caplog.at_level('WARNING'):
    texts = pipeline.split_texts(corpus_config, 'train')
  assert sorted(texts) == sorted(clean + ['# caf\ufffd\n'])  # The binary file is left out.
  [record] = [r for r in caplog.records if r.levelname == 'WARNING']
  assert 'train split' in record.message and 'blob.py' in record.message
  assert '1 binary file(s)' in record.message and 'latin.py' in record.message


def test_a_split_of_binary_files_only_is_refused(tmp_path):
  root = tmp_path / 'corpus'
  root.mkdir()
  (root / 'a.bin').write_bytes(b'\x00' * 10)
  cfg = ml_collections.ConfigDict({'corpus': str(root), 'extensions': ('.bin',),
                                   'valid_fraction': 0.0, 'max_corpus_bytes': -1})
  with pytest.raises(ValueError, match=r'All 1 files of the train split are binary.*a\.bin'):
    pipeline.split_texts(cfg, 'train')


def test_missing_split_files(corpus_config, tmp_path):
  corpus_config.valid_fraction = 0.0
  with pytest.raises(ValueError, match="Split 'valid'.*no files"):
    pipeline.load_or_build_split(corpus_config, tokenizer_lib.byte_tokenizer(), 'valid',
                                 tmp_path)


def test_build_tokenizer(corpus_config, tmp_path):
  assert pipeline.build_tokenizer(corpus_config, 264).kind == 'byte'
  corpus_config.tokenizer = 'bpe'
  tok = pipeline.load_or_build_tokenizer(corpus_config, 300, tmp_path / 'work')
  assert tok.kind == 'bpe' and (tmp_path / 'work' / 'tokenizer.json').exists()
  loaded = pipeline.load_or_build_tokenizer(corpus_config, 9999, tmp_path / 'work')
  assert loaded.to_json() == tok.to_json()
  corpus_config.tokenizer = 'words'
  with pytest.raises(ValueError, match='words'):
    pipeline.build_tokenizer(corpus_config, 300)


def test_a_corrupt_workdir_tokenizer_is_named_not_rebuilt(corpus_config, tmp_path):
  # Training resumes through here: a new tokenizer would silently change every token id.
  pipeline.load_or_build_tokenizer(corpus_config, 300, tmp_path)
  path = tmp_path / tokenizer_lib.FILENAME
  path.write_text(path.read_text()[:100])
  with pytest.raises(ValueError, match=f'{path} is corrupt'):
    pipeline.load_or_build_tokenizer(corpus_config, 300, tmp_path)
  assert len(path.read_text()) == 100


def test_train_iterator_format_and_epochs():
  arrays = _arrays(12)
  it = pipeline.make_train_iterator(arrays, 4, seed=0)
  batches = _take(it, 9)  # three epochs
  for b in batches:
    assert set(b) == set(pipeline.KEYS)
    assert all(v.shape == (4, 4) and v.dtype == np.int32 for v in b.values())
  epochs = [np.concatenate([b['tokens'][:, 0] for b in batches[i:i + 3]]) for i in (0, 3, 6)]
  for rows in epochs:
    assert sorted(rows) == list(range(12))  # each epoch sees every row once
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled per epoch


def test_train_iterator_deterministic():
  arrays = _arrays(50)
  a = _take(pipeline.make_train_iterator(arrays, 8, seed=3), 10)
  b = _take(pipeline.make_train_iterator(arrays, 8, seed=3), 10)
  c = _take(pipeline.make_train_iterator(arrays, 8, seed=4), 10)
  _assert_batches_equal(a, b)
  assert any(not np.array_equal(x['tokens'], y['tokens']) for x, y in zip(a, c))
  d = _take(pipeline.make_train_iterator(arrays, 8, seed=3, prefetch=4), 10)
  _assert_batches_equal(a, d)


@pytest.mark.parametrize('prefetch', [0, 3])
def test_train_iterator_resume_from_state(prefetch):
  arrays = _arrays(30)
  it = pipeline.make_train_iterator(arrays, 4, seed=1, prefetch=prefetch)
  _take(it, 11)
  state = it.get_state()
  want = _take(it, 5)
  fresh = pipeline.make_train_iterator(arrays, 4, seed=1, prefetch=prefetch)
  fresh.set_state(state)
  _assert_batches_equal(_take(fresh, 5), want)


def test_train_iterator_resume_through_orbax(tmp_path):
  arrays = _arrays(30)
  it = pipeline.make_train_iterator(arrays, 6, seed=2)
  _take(it, 7)
  manager = ocp.CheckpointManager(tmp_path / 'ckpt')
  manager.save(7, args=ocp.args.Composite(
      state=ocp.args.StandardSave({'step': np.array(7, np.int32)}),
      data=pipeline.iterator_checkpoint_args(it)))
  want = _take(it, 4)  # advancing after save does not change what was saved
  manager.wait_until_finished()
  manager.close()
  assert json.loads((tmp_path / 'ckpt' / '7' / 'data' / 'metadata').read_text()) == {
      'global_batches': 7}  # One file, whatever the process count.

  manager = ocp.CheckpointManager(tmp_path / 'ckpt')
  fresh = pipeline.make_train_iterator(arrays, 6, seed=2)
  restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
      state=ocp.args.StandardRestore({'step': np.array(0, np.int32)}),
      data=pipeline.iterator_checkpoint_args(fresh, restore=True)))
  manager.close()
  assert int(restored['state']['step']) == 7
  fresh.set_state(restored['data'])
  _assert_batches_equal(_take(fresh, 4), want)


def test_a_position_resumes_onto_another_process_count():
  arrays = _arrays(40)
  whole = pipeline.make_train_iterator(arrays, 8, seed=5)
  _take(whole, 7)  # Into the second epoch.
  state = whole.get_state()
  want = _take(whole, 3)
  parts = []
  for p in range(4):
    part = pipeline.make_train_iterator(arrays, 8, seed=5, process_index=p, process_count=4)
    part.set_state(state)
    parts.append(_take(part, 3))
  for step in range(3):
    for k in pipeline.KEYS:
      np.testing.assert_array_equal(np.concatenate([parts[p][step][k] for p in range(4)]),
                                    want[step][k])


def test_legacy_grain_state_is_read(tmp_path):
  """Checkpoints written by grain's handler: one file per process, the same count in each."""
  for p in range(2):
    (tmp_path / f'process_{p}-of-2.json').write_text(json.dumps({'next_index': 5}))
  assert pipeline.read_legacy_position(tmp_path) == 5
  with pytest.raises(ValueError, match='Not a data position'):
    pipeline.position_from_state({'next_index': -1})
  with pytest.raises(ValueError, match='holds no data iterator state'):
    pipeline.read_legacy_position(tmp_path / 'missing')


def test_process_shards_form_the_global_batch():
  arrays = _arrays(40)
  want = _take(pipeline.make_train_iterator(arrays, 8, seed=5), 6)
  for count in (2, 4, 8):
    shards = [_take(pipeline.make_train_iterator(arrays, 8, seed=5, process_index=p,
                                                 process_count=count), 6)
              for p in range(count)]
    for step, global_batch in enumerate(want):
      for k in pipeline.KEYS:
        joined = np.concatenate([shards[p][step][k] for p in range(count)])
        np.testing.assert_array_equal(joined, global_batch[k])
    assert shards[0][0]['tokens'].shape == (8 // count, 4)


def test_iterator_errors():
  arrays = _arrays(10)
  with pytest.raises(ValueError, match='not divisible by process_count=3'):
    pipeline.make_train_iterator(arrays, 8, seed=0, process_count=3)
  with pytest.raises(ValueError, match="Split 'valid' has 10 rows, fewer than .* of 16"):
    pipeline.make_eval_batches(arrays, 16, 2)
  with pytest.raises(ValueError, match="Split 'train' has 10 rows"):
    pipeline.make_train_iterator(arrays, 16, seed=0)
  with pytest.raises(ValueError, match='process_index'):
    pipeline.make_train_iterator(arrays, 4, seed=0, process_index=2, process_count=2)
  bad = dict(arrays, positions=arrays['positions'][:5])
  with pytest.raises(ValueError, match='one shape'):
    pipeline.make_train_iterator(bad, 4, seed=0)


def test_eval_batches():
  arrays = _arrays(22)
  batches = pipeline.make_eval_batches(arrays, 4, num_batches=3)
  assert [b['tokens'][:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                           [8, 9, 10, 11]]
  assert len(pipeline.make_eval_batches(arrays, 4, num_batches=100)) == 5
  assert len(pipeline.make_eval_batches(arrays, 4, num_batches=None)) == 5
  shard = pipeline.make_eval_batches(arrays, 4, 3, process_index=1, process_count=2)
  assert [b['tokens'][:, 0].tolist() for b in shard] == [[2, 3], [6, 7], [10, 11]]


def test_end_to_end_stdlib_slice(tmp_path):
  """The tiny config's data path: byte tokenizer, capped stdlib corpus."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  cfg = tiny.get_config()
  tok = pipeline.build_tokenizer(cfg.data, cfg.model.vocab_size)
  assert tok.vocab_size <= cfg.model.vocab_size
  train = pipeline.load_or_build_split(cfg.data, tok, 'train', tmp_path)
  valid = pipeline.load_or_build_split(cfg.data, tok, 'valid', tmp_path)
  assert train['tokens'].shape[1] == cfg.data.seq_len
  batch = next(pipeline.make_train_iterator(train, cfg.data.batch_size, cfg.seed))
  assert batch['tokens'].shape == (cfg.data.batch_size, cfg.data.seq_len)
  assert pipeline.make_eval_batches(valid, cfg.data.batch_size, cfg.eval_steps)


def test_pad_equal_to_eos_is_masked_by_segment_ids():
  # Pretrained tokenizers may pad with their eos id (SmolLM2: both 2). The loss and attention
  # read padding from segment id 0, so the documents' own eos tokens still count as labels.
  from mtp.train import loss as loss_lib
  eos = 2
  docs = [np.array([5, 6, eos], np.int32), np.array([7, eos], np.int32)]
  out = pipeline.pack(docs, 4, pad_id=eos)
  np.testing.assert_array_equal(out['tokens'], [[5, 6, eos, 7], [eos, eos, eos, eos]])
  np.testing.assert_array_equal(out['segment_ids'], [[1, 1, 1, 2], [1, 0, 0, 0]])
  labels, valid = loss_lib.shifted_labels(out['tokens'], out['segment_ids'], 1)
  # Predicting each document's eos counts; nothing after the last document does.
  np.testing.assert_array_equal(np.asarray(valid), [[True, True, False, False],
                                                    [False, False, False, False]])
  assert np.asarray(labels)[0, 1] == eos


def test_a_mix_of_sources_shares_the_cap_and_interleaves(tmp_path):
  for source, size in (('code', 40), ('prose', 400)):
    for i in range(30):
      path = tmp_path / source / f'{source}{i:02d}.txt'
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(source[0] * size)
  config = ml_collections.ConfigDict({
      'corpus': f'{tmp_path / "code"}+{tmp_path / "prose"}', 'extensions': ('.txt',),
      'valid_fraction': 0.0, 'tokenizer': 'byte', 'seq_len': 32, 'max_corpus_bytes': 2400})
  texts = pipeline.split_texts(config, 'train')
  chars = ''.join(texts)
  assert chars.count('c') == chars.count('p') == 1200  # Equal shares of the cap.
  # Interleaved by bytes: each half of the documents holds about half of each source.
  first = ''.join(texts[:len(texts) // 2])
  assert 400 <= first.count('c') <= 800 and 400 <= first.count('p') <= 800
  config.corpus = str(tmp_path / 'code')
  assert ''.join(pipeline.split_texts(config, 'train')) == 'c' * 1200  # One source: whole cap.


def test_a_source_without_files_in_a_split_is_named(tmp_path, corpus_config):
  (tmp_path / 'one').mkdir()
  (tmp_path / 'one' / 'only.py').write_text('x = 1\n')
  corpus_config.corpus = f'{corpus_config.corpus}+{tmp_path / "one"}'
  with pytest.raises(ValueError, match="corpus '.*one' has no files"):
    pipeline.split_texts(corpus_config, 'valid')
