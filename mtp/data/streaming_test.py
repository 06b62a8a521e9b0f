"""Tests for mtp.data.streaming: streamed rows and batches are the in-memory pipeline's."""

import json

import numpy as np
import pytest

from mtp.data import pipeline
from mtp.data import prepare
from mtp.data import shards
from mtp.data import streaming
from mtp.data import tokenizer as tokenizer_lib


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  """A JSONL corpus of documents of very different lengths, prepared in small shards."""
  root = tmp_path_factory.mktemp('streaming')
  rng = np.random.default_rng(0)
  texts = [''.join(chr(c) for c in rng.integers(97, 123, size=n))
           for n in rng.integers(0, 300, size=120)]
  (root / 'c.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
  prepare.prepare(str(root / 'c.jsonl'), root / 'ds', num_workers=1, shard_tokens=2000,
                  record_tokens=50)
  return shards.open_dataset(root / 'ds')


def _in_memory(dataset, split, seq_len):
  """What pipeline.pack makes of the same documents: the reference."""
  return pipeline.pack(dataset.split(split).documents(), seq_len, pad_id=0)


@pytest.mark.parametrize('seq_len', [2, 7, 64, 333])
def test_streamed_rows_are_the_packed_rows(dataset, seq_len):
  rows = streaming.split_rows(dataset, 'train', seq_len, tokenizer_lib.byte_tokenizer())
  want = _in_memory(dataset, 'train', seq_len)
  assert rows.num_rows == want['tokens'].shape[0]
  order = np.random.default_rng(seq_len).permutation(rows.num_rows)
  order = np.concatenate([order, [rows.num_rows - 1, 0, rows.num_rows - 1]])  # Repeats too.
  got = rows.take(order)
  for k in pipeline.KEYS:
    np.testing.assert_array_equal(got[k], want[k][order])
  with pytest.raises(IndexError):
    rows.take([rows.num_rows])


def test_streamed_batches_are_the_in_memory_batches(dataset):
  tok = tokenizer_lib.byte_tokenizer()
  memory = _in_memory(dataset, 'train', 32)
  stream = streaming.split_rows(dataset, 'train', 32, tok)
  epoch = memory['tokens'].shape[0] // 8
  want = pipeline.make_train_iterator(memory, 8, seed=3)
  want = [next(want) for _ in range(epoch + 3)]  # Into the second epoch.
  for process_count in (1, 2):
    parts = [pipeline.make_train_iterator(stream, 8, seed=3, process_index=p,
                                          process_count=process_count, prefetch=2)
             for p in range(process_count)]
    for step, batch in enumerate(want):
      got = [next(part) for part in parts]
      for k in pipeline.KEYS:
        np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), batch[k],
                                      err_msg=f'step {step}')
  valid_memory = _in_memory(dataset, 'valid', 16)
  valid_stream = streaming.split_rows(dataset, 'valid', 16, tok)
  for a, b in zip(pipeline.make_eval_batches(valid_stream, 2, 3),
                  pipeline.make_eval_batches(valid_memory, 2, 3), strict=True):
    for k in pipeline.KEYS:
      np.testing.assert_array_equal(a[k], b[k])


def test_a_streamed_iterator_resumes_mid_epoch(dataset):
  stream = streaming.split_rows(dataset, 'train', 16, tokenizer_lib.byte_tokenizer())
  it = pipeline.make_train_iterator(stream, 4, seed=1)
  for _ in range(5):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(3)]
  fresh = pipeline.make_train_iterator(stream, 4, seed=1, prefetch=2)
  fresh.set_state(state)
  for batch in want:
    got = next(fresh)
    for k in pipeline.KEYS:
      np.testing.assert_array_equal(got[k], batch[k])


def test_another_tokenizer_is_named(dataset, tmp_path):
  other = tokenizer_lib.train_bpe(['abcabcabc abc ab'] * 20, 270)
  with pytest.raises(streaming.TokenizerMismatchError,
                     match=r'tokenized with another tokenizer \(byte, 259 ids\) than the one in '
                           r'WORKDIR \(bpe'):
    streaming.check_tokenizer(dataset, other, 'WORKDIR')
  streaming.check_tokenizer(dataset, tokenizer_lib.byte_tokenizer(), 'WORKDIR')
