"""Documents -> packed fixed-length rows -> grain batches, sharded by process.

Batch format (every batch is a dict of numpy int32 arrays, shape [global_batch // process_count,
seq_len]):
  tokens       token ids; each document ends with eos; the last row may end with pad (the
               tokenizer's pad_id, which may equal eos_id).
  segment_ids  1, 2, 3, ... for the document pieces within a row; 0 marks padding (the loss and
               the attention mask read padding from here, never from token ids).
  positions    position within the segment, 0 at every segment start (also at the start of a row
               whose document continues from the previous row).

Rows are made by concatenating all documents and cutting every `seq_len` tokens. The packed
arrays of a split are cached as `.npz` under a cache directory, keyed by the tokenizer, the
files' paths and contents, `seq_len` and `max_corpus_bytes`; a corrupt cache file is rebuilt.

Rows come from a `RowSource`: these in-memory arrays (`ArrayRows`) or a pre-tokenized dataset
streamed from disk (`streaming.StreamedRows`, the same rows for the same documents). The train
iterator (`BatchIterator`) runs a grain pipeline over row indices; its position
(`get_state`/`set_state`) is the number of global batches consumed, the same in every process,
so a run resumes onto any process count: save it beside the train state with Orbax using
`iterator_checkpoint_args` (a JSON item).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any, Protocol

import grain
import numpy as np

from mtp.data import corpora
from mtp.data import tokenizer as tokenizer_lib

Arrays = dict[str, np.ndarray]
KEYS = ('tokens', 'segment_ids', 'positions')
_CACHE_VERSION = 3  # 3: keyed by file contents; binary files skipped.


def tokenize_documents(texts: Sequence[str],
                       tokenizer: tokenizer_lib.Tokenizer) -> list[np.ndarray]:
  """Each text's ids followed by `eos_id`: a list of int32 arrays of shape [len_i + 1]."""
  eos = np.array([tokenizer.eos_id], np.int32)
  return [np.concatenate([ids, eos]) for ids in tokenizer.encode_arrays(list(texts))]


def pack(docs: Sequence[np.ndarray], seq_len: int, *, pad_id: int = 0,
         drop_remainder: bool = False) -> Arrays:
  """Concatenates `docs` and cuts rows of `seq_len` tokens.

  Returns `tokens`, `segment_ids` and `positions`, each int32 [N, seq_len] (see module doc).
  The final partial row is padded (pad_id, segment 0, position 0), or dropped if
  `drop_remainder`.
  """
  if seq_len < 2:
    raise ValueError(f'seq_len must be at least 2, got {seq_len}.')
  lengths = np.array([len(d) for d in docs], np.int64)
  flat = (np.concatenate([np.asarray(d, np.int32) for d in docs]) if len(docs)
          else np.zeros([0], np.int32))
  doc_index = np.repeat(np.arange(len(docs), dtype=np.int64), lengths)
  total = flat.shape[0]
  num_rows = total // seq_len if drop_remainder else -(-total // seq_len)
  size = num_rows * seq_len
  valid = np.arange(size) < total
  tokens = np.full([size], pad_id, np.int32)
  tokens[:min(total, size)] = flat[:size]
  # Padding gets a document index of its own (-1) so it always starts a new piece.
  doc = np.full([size], -1, np.int64)
  doc[:min(total, size)] = doc_index[:size]
  tokens, doc, valid = (x.reshape(num_rows, seq_len) for x in (tokens, doc, valid))

  starts = np.ones_like(doc, dtype=bool)
  starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
  segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
  columns = np.broadcast_to(np.arange(seq_len, dtype=np.int32), doc.shape)
  start_column = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
  positions = (columns - start_column).astype(np.int32)
  segment_ids = np.where(valid, segment_ids, 0).astype(np.int32)
  positions = np.where(valid, positions, 0).astype(np.int32)
  return {'tokens': tokens, 'segment_ids': segment_ids, 'positions': positions}


def split_texts(data_config: Any, split: str) -> list[str]:
  """Texts of the files of `split` ('train' or 'valid'), capped by `max_corpus_bytes`.

  A mix of sources ('stdlib+stdlib_prose') gives each source an equal share of the cap and
  interleaves their documents evenly by bytes, so every stretch of packed rows (an eval
  split's first rows, say) holds some of each. Binary files are skipped and files that are not
  valid UTF-8 read with U+FFFD, with a warning (see `corpora.TextReader`).
  """
  file_lists = _split_file_lists(data_config, split)
  cap = data_config.max_corpus_bytes
  share = max(1, cap // len(file_lists)) if cap > 0 else cap
  return _interleave([_read_capped(files, share, f'{split} split') for files in file_lists])


def _split_file_lists(data_config: Any, split: str) -> list[list[pathlib.Path]]:
  """Files of `split` of each source of the corpus; an error names a source with none."""
  if split not in ('train', 'valid'):
    raise ValueError(f"Unknown split {split!r}; expected one of ['train', 'valid'].")
  lists = corpora.source_file_lists(data_config, split)
  for source, files in zip(corpora.corpus_sources(data_config.corpus), lists):
    if not files:
      raise ValueError(f'Split {split!r} of corpus {source!r} has no files '
                       f'(valid_fraction={data_config.valid_fraction}).')
  return lists


def _split_files(data_config: Any, split: str) -> list[pathlib.Path]:
  return [f for files in _split_file_lists(data_config, split) for f in files]


def _interleave(sources: Sequence[Sequence[str]]) -> list[str]:
  """The documents of every source, merged in order of how far into its source each starts
  (as a fraction of the source's bytes); one source is returned as it is."""
  if len(sources) == 1:
    return list(sources[0])
  keyed = []
  for index, texts in enumerate(sources):
    total = max(1, sum(len(t) for t in texts))
    start = 0
    for text in texts:
      keyed.append((start / total, index, text))
      start += len(text)
  return [text for _, _, text in sorted(keyed, key=lambda k: k[:2])]


def _read_capped(files: Sequence[pathlib.Path], max_bytes: int,
                 what: str = 'corpus') -> list[str]:
  """Texts of `files`, `max_bytes` UTF-8 bytes in all (last one cut); <= 0: every file in order.

  A capped read takes the files in a fixed pseudo-random order (by a hash of each path below
  their common folder), so a small cap samples the whole tree rather than its alphabetical
  start, and the same files are chosen on every machine. Binary files are skipped (they use
  none of the cap); `what` names the files in the warning about them.
  """
  reader = corpora.TextReader()
  if max_bytes <= 0:
    texts = [t for t in map(reader.read, files) if t is not None]
  else:
    root = os.path.commonpath([str(p) for p in files]) if len(files) > 1 else ''

    def rank(path: pathlib.Path) -> str:
      relative = os.path.relpath(path, root) if root else path.name
      return hashlib.sha1(pathlib.PurePath(relative).as_posix().encode()).hexdigest()

    texts, left = [], max_bytes
    for path in sorted(files, key=rank):
      text = reader.read(path)
      if text is None:
        continue
      data = text.encode('utf-8')
      texts.append(data[:left].decode('utf-8', errors='ignore'))
      left -= len(data)
      if left <= 0:
        break
  reader.report(what)
  if files and not texts:
    raise ValueError(f'All {len(files)} files of the {what} are binary (they hold NUL bytes), '
                     f'e.g. {files[0]}: no text to train on.')
  return texts


def build_tokenizer(data_config: Any, vocab_size: int) -> tokenizer_lib.Tokenizer:
  """`data_config.tokenizer`: 'byte', or 'bpe' trained on the (capped) train split."""
  if data_config.tokenizer == 'byte':
    return tokenizer_lib.byte_tokenizer()
  if data_config.tokenizer == 'bpe':
    return tokenizer_lib.train_bpe(split_texts(data_config, 'train'), vocab_size)
  raise ValueError(f"data.tokenizer must be 'bpe' or 'byte', got {data_config.tokenizer!r}.")


def load_or_build_tokenizer(data_config: Any, vocab_size: int,
                            directory: str | pathlib.Path) -> tokenizer_lib.Tokenizer:
  """Loads `directory/tokenizer.json` if present, else builds one and saves it there."""
  path = pathlib.Path(directory) / tokenizer_lib.FILENAME
  if path.exists():
    return tokenizer_lib.Tokenizer.load(path)
  tok = build_tokenizer(data_config, vocab_size)
  tok.save(directory)
  return tok


def _contents_digest(files: Sequence[pathlib.Path], root: pathlib.Path) -> str:
  """A BLAKE2b digest of the files' paths below `root` and their bytes.

  The cache must follow edits that keep a file's size (a changed constant, a fixed typo), so it
  is keyed by contents, not sizes or mtimes; hashing the 12 MB stdlib corpus takes well under
  0.1 s, much less than tokenizing it.
  """
  digest = hashlib.blake2b(digest_size=16)
  for path in files:
    data = path.read_bytes()
    name = path.relative_to(root).as_posix().encode('utf-8')
    # Lengths first, so no two different file lists hash the same bytes.
    digest.update(len(name).to_bytes(8, 'little') + name + len(data).to_bytes(8, 'little'))
    digest.update(data)
  return digest.hexdigest()


def _cache_key(data_config: Any, tokenizer: tokenizer_lib.Tokenizer,
               files: Sequence[pathlib.Path]) -> str:
  desc = {
      'version': _CACHE_VERSION,
      'tokenizer': tokenizer.to_json(),
      'files': _contents_digest(files, corpora.corpus_root(data_config)),
      'seq_len': int(data_config.seq_len),
      'max_corpus_bytes': int(data_config.max_corpus_bytes),
  }
  if tokenizer.special_ids != tokenizer_lib.LEGACY_SPECIAL_IDS:  # eos ends every document.
    desc['special_ids'] = dataclasses.astuple(tokenizer.special_ids)
  return hashlib.sha1(json.dumps(desc, sort_keys=True).encode('utf-8')).hexdigest()[:16]


def _read_cached_split(path: pathlib.Path) -> Arrays | None:
  """The arrays cached at `path`; None (with a warning naming it) if it is unreadable or
  malformed, as after a crash or a full disk: it is only a cache, so the caller rebuilds it."""
  try:
    with np.load(path, allow_pickle=False) as data:
      arrays = {k: data[k] for k in KEYS}
    found = {(a.dtype.name, a.shape) for a in arrays.values()}
    if len(found) != 1 or next(iter(found))[0] != 'int32' or len(next(iter(found))[1]) != 2:
      raise ValueError(f'expected int32 arrays {list(KEYS)} of one shape [rows, seq_len], got '
                       f'{sorted(found)}')
  except Exception as e:  # pylint: disable=broad-except  # zipfile, numpy and OS errors alike.
    logging.warning('The data cache %s is unreadable (%s: %s): rebuilding it.', path,
                    type(e).__name__, e)
    return None
  return arrays


def load_or_build_split(data_config: Any, tokenizer: tokenizer_lib.Tokenizer, split: str,
                        cache_dir: str | pathlib.Path) -> Arrays:
  """Packed arrays of `split`, read from `cache_dir/{split}-{key}.npz` or built and cached.

  The key covers the tokenizer, the files' paths and contents, `seq_len` and
  `max_corpus_bytes`. A corrupt cache file is reported and rebuilt; a new one is written to a
  temporary name and renamed, so readers never see half a file.
  """
  files = _split_files(data_config, split)
  cache_dir = pathlib.Path(cache_dir)
  path = cache_dir / f'{split}-{_cache_key(data_config, tokenizer, files)}.npz'
  if path.exists():
    arrays = _read_cached_split(path)
    if arrays is not None:
      return arrays
  start = time.perf_counter()
  texts = split_texts(data_config, split)
  arrays = pack(tokenize_documents(texts, tokenizer), data_config.seq_len,
                pad_id=tokenizer.pad_id)
  logging.info('Built %s split: %d files, %d rows of %d tokens in %.1fs -> %s', split,
               len(texts), arrays['tokens'].shape[0], data_config.seq_len,
               time.perf_counter() - start, path)
  cache_dir.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f'{path.stem}.{os.getpid()}.tmp.npz')
  try:
    np.savez(tmp, **arrays)
    tmp.replace(path)
  finally:
    tmp.unlink(missing_ok=True)  # Left only when writing failed (a full disk, say).
  return arrays


class RowSource(Protocol):
  """Packed rows read by index: the in-memory arrays (`ArrayRows`) or a streamed dataset
  (`streaming.StreamedRows`)."""
  num_rows: int

  def take(self, rows: np.ndarray) -> Arrays:
    """Rows `rows` (int [B]) of every array: dict of [B, seq_len, ...]."""


@dataclasses.dataclass(frozen=True)
class ArrayRows:
  """Rows of in-memory arrays that share their first two dimensions [rows, seq_len]."""
  arrays: Mapping[str, np.ndarray]

  def __post_init__(self):
    shapes = {k: np.shape(v)[:2] for k, v in self.arrays.items()}  # Features may follow.
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()), ())) != 2:
      raise ValueError(f'Arrays must all start with one shape [rows, seq_len], got {shapes}.')

  @property
  def num_rows(self) -> int:
    return int(np.shape(next(iter(self.arrays.values())))[0])

  def take(self, rows: np.ndarray) -> Arrays:
    return {k: np.asarray(v[rows]) for k, v in self.arrays.items()}


def as_rows(data: Mapping[str, np.ndarray] | RowSource) -> RowSource:
  """`data` as a RowSource (a mapping of arrays is wrapped in `ArrayRows`)."""
  return ArrayRows(data) if isinstance(data, Mapping) else data


def _check_batching(rows: RowSource, global_batch_size: int, process_index: int,
                    process_count: int, split: str) -> int:
  """Validates the arguments and returns the per-process batch size."""
  if global_batch_size <= 0:
    raise ValueError(f'global_batch_size must be positive, got {global_batch_size}.')
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(f'Bad process_index={process_index} for process_count={process_count}.')
  if global_batch_size % process_count:
    raise ValueError(f'global_batch_size={global_batch_size} is not divisible by '
                     f'process_count={process_count}.')
  if rows.num_rows < global_batch_size:
    raise ValueError(f'Split {split!r} has {rows.num_rows} rows, fewer than one global batch of '
                     f'{global_batch_size}: use a smaller batch or seq_len, or more data '
                     '(max_corpus_bytes).')
  return global_batch_size // process_count


@dataclasses.dataclass(frozen=True)
class _TakeRows(grain.transforms.Map):
  """Global batch of row indices -> this process's rows of every array."""
  rows: RowSource
  start: int
  stop: int

  def map(self, indices: np.ndarray) -> Arrays:
    return self.rows.take(np.asarray(indices)[self.start:self.stop])


# The saved data position: global batches consumed, the same for every process count.
POSITION_KEY = 'global_batches'


class BatchIterator:
  """This process's part of an endless sequence of global batches, and its position.

  The position (`get_state()`: {'global_batches': n}) counts global batches consumed. Every
  process consumes the same global batches, so it is the same in all of them and restores onto
  any process count (`set_state`). It also reads grain's own state ({'next_index': n}, in
  checkpoints written before), which counts the same thing.
  """

  def __init__(self, batches: grain.MapDataset, options: grain.ReadOptions):
    self._batches = batches
    self._options = options
    self._position = 0
    self._iterator = None

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> Arrays:
    if self._iterator is None:
      self._iterator = iter(self._batches[self._position:].to_iter_dataset(self._options))
    batch = next(self._iterator)
    self._position += 1
    return batch

  @property
  def position(self) -> int:
    return self._position

  def get_state(self) -> dict[str, int]:
    return {POSITION_KEY: self._position}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._position = position_from_state(state)
    self._iterator = None  # Restarts at the new position on next().


def position_from_state(state: Mapping[str, Any]) -> int:
  """Global batches consumed, from a saved position or grain's legacy iterator state."""
  for key in (POSITION_KEY, 'next_index'):
    value = state.get(key) if isinstance(state, Mapping) else None
    if isinstance(value, int) and value >= 0:
      return value
  raise ValueError(f'Not a data position: {state!r} (expected {{"{POSITION_KEY}": n}}).')


def make_train_iterator(data: Mapping[str, np.ndarray] | RowSource, global_batch_size: int,
                        seed: int, process_index: int = 0, process_count: int = 1, *,
                        split: str = 'train', prefetch: int = 0) -> BatchIterator:
  """Infinite, shuffled (differently each epoch) batches of [global_batch / process_count, L].

  `data` is a mapping of packed arrays or any `RowSource` (a streamed dataset). Process p gets
  rows [p * b, (p + 1) * b) of every global batch (b the per-process batch), so the global batch
  is the same for every `process_count`. Everything is deterministic in `seed`;
  `get_state()`/`set_state()` resume exactly, with any process count. `prefetch` > 0 prepares
  that many batches ahead in as many background threads (grain worker processes were slower
  for streamed rows on 2 cores, measured: the reading is cheap, the copies between processes
  are not).
  """
  rows = as_rows(data)
  per_process = _check_batching(rows, global_batch_size, process_index, process_count, split)
  ds = (grain.MapDataset.range(rows.num_rows)
        .shuffle(seed=seed)
        .repeat(None)
        .batch(global_batch_size, drop_remainder=True)
        .map(_TakeRows(rows, process_index * per_process, (process_index + 1) * per_process)))
  options = grain.ReadOptions(num_threads=max(prefetch, 1) if prefetch > 0 else 0,
                              prefetch_buffer_size=max(prefetch, 0))
  return BatchIterator(ds, options)


def iterator_checkpoint_args(iterator: BatchIterator, restore: bool = False) -> Any:
  """Orbax args saving the iterator's position (JSON; process 0 writes it), or reading one.

  Use as one item of `ocp.args.Composite(...)`; after a restore, pass the restored item to
  `iterator.set_state`.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  # Trainers only.
  if restore:
    return ocp.args.JsonRestore()
  return ocp.args.JsonSave(iterator.get_state())


def read_legacy_position(directory: str | os.PathLike) -> int:
  """The position in a checkpoint item written by grain's handler (`process_{i}-of-{n}.json`).

  Every process saved the same count of global batches, so any one of the files restores any
  process count.
  """
  files = sorted(pathlib.Path(directory).glob('process_*-of-*.json'))
  if not files:
    raise ValueError(f'{directory} holds no data iterator state (process_*-of-*.json).')
  try:
    return position_from_state(json.loads(files[0].read_text()))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{files[0]} is not a readable data iterator state ({e}).') from e


def make_eval_batches(data: Mapping[str, np.ndarray] | RowSource, global_batch_size: int,
                      num_batches: int | None, process_index: int = 0, process_count: int = 1,
                      *, split: str = 'valid') -> list[Arrays]:
  """The first `num_batches` global batches in order (no shuffle), this process's rows of each.

  Returns fewer batches if the split is short (at least one); None takes all full batches.
  Each batch is a dict of int32 [global_batch / process_count, seq_len].
  """
  rows = as_rows(data)
  per_process = _check_batching(rows, global_batch_size, process_index, process_count, split)
  available = rows.num_rows // global_batch_size
  count = available if num_batches is None else min(num_batches, available)
  batches = []
  for b in range(count):
    start = b * global_batch_size + process_index * per_process
    batches.append(rows.take(np.arange(start, start + per_process)))
  return batches

