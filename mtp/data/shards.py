"""A pre-tokenized dataset on disk: ArrayRecord shards, their document offsets, and a manifest.

Layout of a dataset directory (written by `launch.prepare_data`):
  manifest.json              format, version, source, tokenizer (kind, vocab size, hash, special
                             ids), token dtype, and per split its document and token counts and
                             its shards (paths, counts), in order
  tokenizer.json             the tokenizer (plus special_tokens.json etc. as `Tokenizer.save`)
  train/00000.array_record   the shard's documents (each ending with eos) concatenated and cut
                             into records of `record_tokens` ids (the last one shorter), as raw
                             little-endian `token_dtype` (uint16 when the vocabulary fits, else
                             int32: half the disk and page cache for vocabularies up to 65536)
  train/00000.offsets.npy    int64 [num_documents + 1]: where each document starts in the shard's
                             concatenated tokens (0 first, num_tokens last)
  valid/...                  the same for the valid split
A shard holds whole documents. Records are fixed-size pieces of the token stream, not documents:
a training row is drawn uniformly over tokens, so it lands in a long document more often than a
short one, and reading whole documents would cost the mean of length squared over length per
row (about 1 ms a row on the standard library's files, measured); a piece costs
`record_tokens` + seq_len at most.

`SplitReader` reads any token range of a split's concatenated documents by random access; its
memory does not grow with the corpus (offsets are memory-mapped, records read on demand).

A dataset may live on an object store (`gs://bucket/tokens`): the manifest and tokenizer are
read through etils.epath, and each shard (records and offsets) is copied to this host's cache
(`paths.local_copy`) the first time a read touches it, since ArrayRecord's reader and memory maps
take only local files. A host then holds the shards its rows come from, at most the dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

from etils import epath
import numpy as np

from mtp.checkpoint import paths
from mtp.data import tokenizer as tokenizer_lib

MANIFEST_FILENAME = 'manifest.json'
FORMAT = 'mtp-pretokenized'
VERSION = 1
SPLITS = ('train', 'valid')
RECORD_SUFFIX = '.array_record'
OFFSETS_SUFFIX = '.offsets.npy'
# One record per group: a random read decodes just the piece it wants.
WRITER_OPTIONS = 'group_size:1'
DEFAULT_RECORD_TOKENS = 4096
READER_OPTIONS = 'readahead_buffer_size:0'


class DatasetError(ValueError):
  """A dataset directory that is missing, incomplete or does not fit the run."""


def tokenizer_hash(tokenizer: tokenizer_lib.Tokenizer) -> str:
  """SHA-256 of the tokenizer's HF JSON and its special ids: equal hashes, equal ids."""
  digest = hashlib.sha256(tokenizer.to_json().encode('utf-8'))
  digest.update(tokenizer.special_ids.to_json().encode('utf-8'))
  return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _record_writer(path: pathlib.Path):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  return array_record_module.ArrayRecordWriter(str(path), WRITER_OPTIONS)


def _record_reader(path: pathlib.Path):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  return array_record_module.ArrayRecordReader(str(path), READER_OPTIONS)


class SplitWriter:
  """Appends documents to the shards of one split, starting a new shard every `shard_tokens`."""

  def __init__(self, directory: pathlib.Path, split: str, dtype: np.dtype, shard_tokens: int,
               record_tokens: int = DEFAULT_RECORD_TOKENS):
    if shard_tokens <= 0 or record_tokens <= 0:
      raise ValueError(f'shard_tokens ({shard_tokens}) and record_tokens ({record_tokens}) must '
                       'be positive.')
    self._root = directory
    self._split = split
    self._dtype = np.dtype(dtype)
    self._shard_tokens = shard_tokens
    self._record_tokens = record_tokens
    (directory / split).mkdir(parents=True, exist_ok=True)
    self.shards: list[dict[str, Any]] = []
    self._writer = None
    self._offsets: list[int] = []
    self._pending: list[np.ndarray] = []  # Tokens not yet written: under one record.
    self._pending_size = 0

  def add(self, tokens: np.ndarray) -> None:
    """Appends one document (int ids, eos included)."""
    tokens = np.asarray(tokens)
    if not tokens.size:
      raise ValueError('A document has at least its eos token.')
    if self._writer is None:
      self._name = f'{self._split}/{len(self.shards):05d}'
      self._writer = _record_writer(self._root / f'{self._name}{RECORD_SUFFIX}')
      self._offsets = [0]
    self._pending.append(tokens.astype(self._dtype, copy=False))
    self._pending_size += tokens.size
    self._offsets.append(self._offsets[-1] + tokens.size)
    if self._pending_size >= self._record_tokens:
      self._flush(final=False)
    if self._offsets[-1] >= self._shard_tokens:
      self._close_shard()

  def _flush(self, final: bool) -> None:
    """Writes the pending tokens as full records (and the rest too if `final`)."""
    data = np.concatenate(self._pending) if self._pending else np.zeros([0], self._dtype)
    full = len(data) - len(data) % self._record_tokens
    for start in range(0, full, self._record_tokens):
      self._writer.write(data[start:start + self._record_tokens].tobytes())
    rest = data[full:]
    if final and len(rest):
      self._writer.write(rest.tobytes())
      rest = rest[:0]
    self._pending, self._pending_size = [rest], len(rest)

  def _close_shard(self) -> None:
    self._flush(final=True)
    self._writer.close()
    self._writer = None
    offsets = np.asarray(self._offsets, np.int64)
    np.save(self._root / f'{self._name}{OFFSETS_SUFFIX}', offsets)
    self.shards.append({'records': f'{self._name}{RECORD_SUFFIX}',
                        'offsets': f'{self._name}{OFFSETS_SUFFIX}',
                        'num_documents': len(offsets) - 1, 'num_tokens': int(offsets[-1])})

  def close(self) -> dict[str, Any]:
    """Finishes the last shard; returns the split's manifest entry."""
    if self._writer is not None:
      self._close_shard()
    return {'num_documents': sum(s['num_documents'] for s in self.shards),
            'num_tokens': sum(s['num_tokens'] for s in self.shards),
            'shards': self.shards}


@dataclasses.dataclass(frozen=True)
class Dataset:
  """An opened dataset directory: its manifest, checked against the files."""
  directory: epath.Path
  manifest: dict[str, Any]

  @property
  def tokenizer_hash(self) -> str:
    return self.manifest['tokenizer']['sha256']

  def tokenizer(self) -> tokenizer_lib.Tokenizer:
    return tokenizer_lib.Tokenizer.load(self.directory)

  def split(self, name: str) -> SplitReader:
    entry = self.manifest['splits'].get(name)
    if not entry or not entry['shards']:
      raise DatasetError(f'Dataset {self.directory} has no {name!r} documents (see '
                         f'{self.directory / MANIFEST_FILENAME}).')
    return SplitReader(self.directory, entry['shards'], np.dtype(self.manifest['token_dtype']),
                       int(self.manifest['record_tokens']))


def open_dataset(directory: str | os.PathLike, what: str = 'config.data.source') -> Dataset:
  """Reads and checks `directory/manifest.json` and that every shard it lists is there.

  Args:
    directory: the dataset directory, local or on an object store (`gs://...`).
    what: the flag or config key `directory` came from, named in errors.

  Raises:
    DatasetError: naming the missing or malformed path.
  """
  try:
    directory = paths.path_or_url(directory, what)
  except ValueError as e:
    raise DatasetError(str(e)) from None
  if not directory.is_dir():
    raise DatasetError(f'{what}={directory}: the dataset directory does not exist (make one '
                       'with python -m launch.prepare_data --output=...).')
  path = directory / MANIFEST_FILENAME
  if not path.is_file():
    raise DatasetError(f'{path} is missing: {directory} is not a prepared dataset (or its '
                       'preparation did not finish).')
  try:
    manifest = json.loads(path.read_text(encoding='utf-8'))
    if manifest.get('format') != FORMAT:
      raise ValueError(f'format is {manifest.get("format")!r}, not {FORMAT!r}')
    if manifest.get('version') != VERSION:
      raise ValueError(f'version {manifest.get("version")} is not {VERSION}')
    splits = manifest['splits']
    np.dtype(manifest['token_dtype'])
    if int(manifest['record_tokens']) <= 0:
      raise ValueError(f'record_tokens is {manifest["record_tokens"]}')
    manifest['tokenizer']['sha256']  # pylint: disable=pointless-statement
  except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
    raise DatasetError(f'{path} is not a readable manifest ({type(e).__name__}: {e}).') from e
  if not splits.get('train', {}).get('shards'):
    raise DatasetError(f'{directory / "train"} holds no shard: the dataset has no training '
                       'documents.')
  if not (directory / tokenizer_lib.FILENAME).is_file():
    raise DatasetError(f'{directory / tokenizer_lib.FILENAME} is missing: the dataset\'s '
                       'tokenizer is needed to train on it.')
  for split, entry in splits.items():
    for shard in entry['shards']:
      for key in ('records', 'offsets'):
        if not (directory / shard[key]).is_file():
          raise DatasetError(f'{directory / shard[key]} is missing: the {split!r} split of '
                             f'{directory} is incomplete.')
  return Dataset(directory, manifest)


class SplitReader:
  """Random access to the concatenated tokens of one split's documents, in order.

  Safe to pickle (grain worker processes): files are opened lazily in each process.
  """

  def __init__(self, directory: str | os.PathLike, shards: Sequence[dict[str, Any]],
               dtype: np.dtype, record_tokens: int):
    self._directory = os.fspath(directory)  # A string: pickles the same for every backend.
    self._shards = [dict(s) for s in shards]
    self._dtype = np.dtype(dtype)
    self._record_tokens = record_tokens
    sizes = np.array([s['num_tokens'] for s in self._shards], np.int64)
    self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
    self.num_tokens = int(self._shard_starts[-1])
    self.num_documents = sum(int(s['num_documents']) for s in self._shards)
    self._readers: dict[int, Any] = {}
    self._offsets: dict[int, np.ndarray] = {}

  def __getstate__(self):
    state = dict(self.__dict__)
    state['_readers'], state['_offsets'] = {}, {}
    return state

  def _local(self, shard: int, key: str) -> pathlib.Path:
    """A local path of the shard's `key` file ('records' or 'offsets'): the file itself, or
    this host's copy of one on an object store."""
    return paths.local_copy(epath.Path(self._directory) / self._shards[shard][key])

  def _shard_offsets(self, shard: int) -> np.ndarray:
    if shard not in self._offsets:
      self._offsets[shard] = np.load(self._local(shard, 'offsets'), mmap_mode='r')
    return self._offsets[shard]

  def _read(self, shard: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of one shard's concatenation."""
    if shard not in self._readers:
      self._readers[shard] = _record_reader(self._local(shard, 'records'))
    size = self._record_tokens
    first, last = start // size, (stop - 1) // size
    records = self._readers[shard].read(list(range(first, last + 1)))
    data = np.frombuffer(b''.join(records), self._dtype)
    return data[start - first * size:stop - first * size]

  def pieces(self, start: int, stop: int) -> list[np.ndarray]:
    """Tokens [start, stop) of the split, as one int32 array per document piece, in order."""
    if not 0 <= start <= stop <= self.num_tokens:
      raise IndexError(f'Token range [{start}, {stop}) is outside [0, {self.num_tokens}).')
    out: list[np.ndarray] = []
    shard = int(np.searchsorted(self._shard_starts, start, side='right')) - 1
    while start < stop:
      base = int(self._shard_starts[shard])
      local_start, local_stop = start - base, min(stop, int(self._shard_starts[shard + 1])) - base
      tokens = self._read(shard, local_start, local_stop).astype(np.int32)
      offsets = self._shard_offsets(shard)
      # Document starts strictly inside the range cut it into pieces.
      lo = int(np.searchsorted(offsets, local_start, side='right'))
      hi = int(np.searchsorted(offsets, local_stop, side='left'))
      cuts = np.asarray(offsets[lo:hi], np.int64) - local_start
      out.extend(np.split(tokens, cuts))
      start = base + local_stop
      shard += 1
    return out

  def documents(self) -> list[np.ndarray]:
    """Every document of the split (small splits and tests only: it reads them all)."""
    out = []
    for shard in range(len(self._shards)):
      offsets = np.asarray(self._shard_offsets(shard), np.int64)
      tokens = self._read(shard, 0, int(offsets[-1])).astype(np.int32)
      out.extend(np.split(tokens, offsets[1:-1]))
    return out
