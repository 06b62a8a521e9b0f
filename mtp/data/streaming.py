"""Training rows streamed from a pre-tokenized dataset (`shards`), packed on the fly.

Row r of a split is tokens [r * L, (r + 1) * L) of the concatenation of its documents (L =
seq_len), cut and marked exactly as `pipeline.pack` cuts the same documents in memory: the last
row is padded, segments restart at every document and at every row. The shuffled order, the
global batches and their split over processes are `pipeline.make_train_iterator`'s, so a
streamed run sees the batches an in-memory run of the same documents would. Each process reads
only the rows of its own part of each batch, by random access; nothing grows with the corpus.
"""

from __future__ import annotations

import numpy as np

from mtp.data import pipeline
from mtp.data import shards
from mtp.data import tokenizer as tokenizer_lib


class TokenizerMismatchError(shards.DatasetError):
  """The dataset was tokenized with another tokenizer than the workdir's."""


class StreamedRows:
  """`pipeline.RowSource` over one split of a dataset: rows of `seq_len` tokens, by index."""

  def __init__(self, reader: shards.SplitReader, seq_len: int, pad_id: int):
    if seq_len < 2:
      raise ValueError(f'seq_len must be at least 2, got {seq_len}.')
    self._reader = reader
    self.seq_len = seq_len
    self.pad_id = pad_id
    self.num_rows = -(-reader.num_tokens // seq_len)

  def take(self, rows: np.ndarray) -> pipeline.Arrays:
    """Rows `rows` (int [B]): `tokens`, `segment_ids`, `positions`, each int32 [B, seq_len]."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    if rows.size and not (0 <= rows.min() and rows.max() < self.num_rows):
      raise IndexError(f'Rows {rows.tolist()} are outside [0, {self.num_rows}).')
    pieces = [self._pieces(int(r)) for r in rows]
    full = np.array([sum(map(len, p)) == self.seq_len for p in pieces], bool)
    out = {k: np.empty([len(rows), self.seq_len], np.int32) for k in pipeline.KEYS}
    if full.any():  # Full rows pack in one call: their pieces end exactly at row boundaries.
      packed = pipeline.pack([x for p, f in zip(pieces, full) if f for x in p], self.seq_len,
                             pad_id=self.pad_id)
      for k in pipeline.KEYS:
        out[k][full] = packed[k]
    for i in np.flatnonzero(~full):  # The split's last row, padded.
      packed = pipeline.pack(pieces[i], self.seq_len, pad_id=self.pad_id)
      for k in pipeline.KEYS:
        out[k][i] = packed[k][0]
    return out

  def _pieces(self, row: int) -> list[np.ndarray]:
    start = row * self.seq_len
    return self._reader.pieces(start, min(start + self.seq_len, self._reader.num_tokens))


def check_tokenizer(dataset: shards.Dataset, tokenizer: tokenizer_lib.Tokenizer,
                    where: str, *, dataset_name: str | None = None,
                    tokenizer_name: str | None = None, remedy: str | None = None) -> None:
  """Raises TokenizerMismatchError unless `tokenizer` (the one at `where`) made the dataset.

  The message names the dataset (`dataset_name`, default its directory) and the tokenizer's
  home (`tokenizer_name`, default 'the one in WHERE'), and ends with `remedy` (default: a new
  workdir, or data prepared with WHERE's tokenizer)."""
  if shards.tokenizer_hash(tokenizer) != dataset.tokenizer_hash:
    made = dataset.manifest['tokenizer']
    remedy = remedy or f'use a new workdir, or prepare the data with --tokenizer={where}'
    raise TokenizerMismatchError(
        f'The dataset {dataset_name or dataset.directory} was tokenized with another tokenizer '
        f'({made["kind"]}, {made["vocab_size"]} ids) than {tokenizer_name or f"the one in {where}"}'
        f' ({tokenizer.kind}, {tokenizer.vocab_size} ids): {remedy}.')


def split_rows(dataset: shards.Dataset, split: str, seq_len: int,
               tokenizer: tokenizer_lib.Tokenizer) -> StreamedRows:
  """Rows of `split` ('train' or 'valid'), padded with the tokenizer's pad id."""
  return StreamedRows(dataset.split(split), seq_len, tokenizer.pad_id)
