"""Tokenizes a corpus once, in parallel, into a sharded dataset directory (see `shards`).

Documents stream from the source (`sources`) in chunks to worker processes that read (files) and
tokenize them; the parent writes their ids in source order, so the result does not depend on the
number of workers. At most a few chunks per worker are in flight: memory does not grow with the
corpus. A worker that cannot start (its tokenizer unreadable) or that dies ends the run with one
error. Everything is written to a staging directory beside the output and renamed into place at
the end, so a killed run leaves no half dataset under the output's name. An output on an object
store (`gs://...`) is staged in this host's cache and uploaded at the end, its manifest last: a
dataset without its manifest is not one (`shards.open_dataset`). The output's lock
(`<output>.lock`, `checkpoint/workdir_lock.py`, as `launch.export` takes its output's) keeps a
second run on the same output out: it would take the first's staging directory for a killed
run's.
"""

from __future__ import annotations

from collections.abc import Iterator
import collections
from concurrent import futures
import json
import logging
import multiprocessing
import os
import pathlib
import shutil
import time
from typing import Any

from etils import epath
import numpy as np

from mtp.checkpoint import paths
from mtp.checkpoint import workdir_lock
from mtp.data import corpora
from mtp.data import shards
from mtp.data import sources
from mtp.data import tokenizer as tokenizer_lib

DEFAULT_SHARD_TOKENS = 64 * 2**20
DEFAULT_BPE_SAMPLE_BYTES = 256 * 2**20
# A chunk (one task for a worker) closes at this many documents or inline text bytes.
CHUNK_DOCUMENTS = 256
CHUNK_BYTES = 2**20
STAGING_MARK = '.staging-'


class PrepareError(ValueError):
  """Arguments that cannot make a dataset (the output exists, an unknown tokenizer, ...)."""


def prepare(source: str, output: str | pathlib.Path, *, tokenizer: str = 'byte',
            vocab_size: int = 4096, text_field: str = 'text', id_field: str = '',
            extensions: tuple[str, ...] = ('.py',), valid_fraction: float = 0.05,
            num_workers: int = 0, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            bpe_sample_bytes: int = DEFAULT_BPE_SAMPLE_BYTES,
            record_tokens: int = shards.DEFAULT_RECORD_TOKENS,
            overwrite: bool = False) -> dict[str, Any]:
  """Writes the dataset of `source` to `output`; returns its manifest plus `stats`.

  Args:
    source: a directory, `stdlib`, a .jsonl or .parquet file or a glob of them (`sources`).
    output: the dataset directory to create, local or on an object store (`gs://...`: written
      locally under `paths.host_cache_root()`, then uploaded, its manifest last).
    tokenizer: 'byte'; 'bpe' (trained on up to `bpe_sample_bytes` of the train split's text,
      `vocab_size` ids); or a directory holding a tokenizer.json (a training workdir, another
      dataset) to reuse.
    vocab_size: the BPE vocabulary size.
    text_field, id_field: the record fields holding the text and (optional) the key the split
      hashes; records only.
    extensions: file suffixes read from a directory (the others are counted, named in a
      warning and in the manifest's `skipped`).
    valid_fraction: the share of documents held out, by a hash of each key.
    num_workers: tokenizing processes; 0 uses every CPU, 1 tokenizes in this process.
    shard_tokens: a shard closes once it holds this many tokens.
    bpe_sample_bytes: the text a BPE tokenizer is trained on, at most.
    record_tokens: tokens per ArrayRecord record (what one random read decodes).
    overwrite: replace an existing dataset at `output`.

  Raises:
    PrepareError, sources.SourceError: bad arguments, before anything is written.
    ValueError: `source` is a URL (`gs://...`): sources are read from local files only; or
      `output` or `tokenizer` is a URL of another scheme than gs://, or gcsfs is missing.
    workdir_lock.WorkdirLockedError: another run writes `output`.
  """
  # The source is read with local file APIs: a URL is refused by name, never folded into a
  # local path. The output and a tokenizer directory may be on an object store.
  paths.local_path(source, '--source')
  output = paths.path_or_url(output, '--output')
  if not paths.is_url(output):
    output = pathlib.Path(output)
  if tokenizer not in ('byte', 'bpe'):
    paths.path_or_url(tokenizer, '--tokenizer')
  if output.exists() and not overwrite:
    raise PrepareError(f'{output} already exists: choose another --output or pass --overwrite.')
  if not 0.0 <= valid_fraction < 1.0:
    raise PrepareError(f'valid_fraction must be in [0, 1), got {valid_fraction}.')
  if shard_tokens <= 0 or record_tokens <= 0:
    raise PrepareError(f'shard_tokens ({shard_tokens}) and record_tokens ({record_tokens}) must '
                       'be positive.')
  if num_workers < 0:
    raise PrepareError(f'num_workers must be >= 0, got {num_workers}.')
  corpus = sources.open_source(source, text_field=text_field, id_field=id_field,
                               extensions=extensions)
  if corpus.other_files:
    logging.warning('Skipped %d files under %s: --extensions reads only %s (pass, say, '
                    '--extensions=.py,.md to read others too).', corpus.other_files, source,
                    list(extensions))
  with workdir_lock.WorkdirLock(output):
    if output.exists() and not overwrite:  # Made by another run before the lock was ours.
      raise PrepareError(f'{output} already exists: choose another --output or pass '
                         '--overwrite.')
    result = _write(corpus, output, tokenizer, vocab_size, valid_fraction, num_workers,
                    shard_tokens, bpe_sample_bytes, record_tokens)
  if not result['splits']['valid']['num_documents']:
    logging.warning('The validation split is empty (--valid_fraction=%g held out none of %d '
                    'documents): train on %s with --config.eval_steps=0.', valid_fraction,
                    result['num_documents'], output)
  return result


def _write(corpus: sources.Source, output: os.PathLike, tokenizer: str, vocab_size: int,
           valid_fraction: float, num_workers: int, shard_tokens: int, bpe_sample_bytes: int,
           record_tokens: int) -> dict[str, Any]:
  """`prepare` once the output's lock is held: the staging directory, filled and renamed."""
  tok = _tokenizer(tokenizer, corpus, valid_fraction, vocab_size, bpe_sample_bytes)
  _remove_stale_staging(output)
  staging = paths.staging_parent(output) / f'.{output.name}{STAGING_MARK}{os.getpid()}'
  staging.mkdir(parents=True)
  try:
    start = time.perf_counter()
    tok.save(staging)
    dtype = shards.token_dtype(tok.vocab_size)
    writers = {s: shards.SplitWriter(staging, s, dtype, shard_tokens, record_tokens)
               for s in shards.SPLITS}
    skipped = collections.Counter()
    for split, ids in _tokenized(corpus, valid_fraction, staging, num_workers, skipped):
      writers[split].add(ids)
    splits = {s: w.close() for s, w in writers.items()}
    if not splits['train']['num_documents']:
      raise PrepareError(f'Source {corpus.spec!r} gave no training documents '
                         f'(skipped: {dict(skipped)}).')
    seconds = time.perf_counter() - start
    skipped['null_texts'] = corpus.skipped_nulls
    skipped['other_extensions'] = corpus.other_files
    manifest = {
        'format': shards.FORMAT, 'version': shards.VERSION,
        'source': corpus.describe(), 'valid_fraction': valid_fraction,
        'tokenizer': {'kind': tok.kind, 'vocab_size': tok.vocab_size,
                      'sha256': shards.tokenizer_hash(tok),
                      'special_ids': json.loads(tok.special_ids.to_json()),
                      'file': tokenizer_lib.FILENAME, 'from': tokenizer},
        'token_dtype': dtype.name, 'record_tokens': record_tokens,
        'num_tokens': sum(s['num_tokens'] for s in splits.values()),
        'num_documents': sum(s['num_documents'] for s in splits.values()),
        'skipped': {k: v for k, v in sorted(skipped.items()) if v},
        'splits': splits,
    }
    (staging / shards.MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=1) + '\n')
    _commit(staging, output)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  stats = {'seconds': seconds, 'tokens_per_sec': manifest['num_tokens'] / max(seconds, 1e-9),
           'num_workers': _resolve_workers(num_workers)}
  logging.info('Prepared %s: %d documents, %d tokens in %.1fs (%.0f tokens/s).', output,
               manifest['num_documents'], manifest['num_tokens'], seconds,
               stats['tokens_per_sec'])
  return {**manifest, 'stats': stats}


def _tokenizer(spec: str, corpus: sources.Source, valid_fraction: float, vocab_size: int,
               sample_bytes: int) -> tokenizer_lib.Tokenizer:
  if spec == 'byte':
    return tokenizer_lib.byte_tokenizer()
  if spec == 'bpe':
    return tokenizer_lib.train_bpe(_train_sample(corpus, valid_fraction, sample_bytes),
                                   vocab_size)
  path = paths.path_or_url(spec, '--tokenizer')
  try:
    return tokenizer_lib.Tokenizer.load(path)
  except FileNotFoundError as e:
    raise PrepareError(f"--tokenizer must be 'byte', 'bpe' or a directory holding a "
                       f'{tokenizer_lib.FILENAME}; {spec!r} is none of them.') from e


def _train_sample(corpus: sources.Source, valid_fraction: float,
                  sample_bytes: int) -> Iterator[str]:
  """Texts of the train split, in order, up to `sample_bytes` UTF-8 bytes."""
  reader = corpora.TextReader()
  left = sample_bytes
  for split, doc in corpus.split_documents(valid_fraction):
    if split != 'train':
      continue
    text = doc.text if doc.path is None else reader.read(doc.path)
    if text is None:
      continue
    yield text
    left -= len(text.encode('utf-8'))
    if left <= 0:
      return


def _resolve_workers(num_workers: int) -> int:
  return num_workers or os.cpu_count() or 1


def _chunks(corpus: sources.Source, valid_fraction: float
            ) -> Iterator[list[tuple[str, sources.Document]]]:
  chunk, size = [], 0
  for item in corpus.split_documents(valid_fraction):
    chunk.append(item)
    size += len(item[1].text or '')
    if len(chunk) >= CHUNK_DOCUMENTS or size >= CHUNK_BYTES:
      yield chunk
      chunk, size = [], 0
  if chunk:
    yield chunk


def _tokenized(corpus: sources.Source, valid_fraction: float, staging: pathlib.Path,
               num_workers: int, skipped: collections.Counter
               ) -> Iterator[tuple[str, np.ndarray]]:
  """(split, ids with eos) of every document in source order; binary files are left out."""
  workers = _resolve_workers(num_workers)
  chunks = _chunks(corpus, valid_fraction)
  if workers == 1:
    _init_worker(str(staging), threads=True)  # The tokenizer's own threads, if any.
    results = map(_tokenize_chunk, chunks)
    for docs, counts in results:
      skipped.update(counts)
      yield from docs
    return
  # Spawned, not forked: the parent may run tokenizer threads already (BPE training). Not a
  # multiprocessing.Pool: it respawns a worker that fails at start without end, and waits
  # forever for the task of one that died; this pool breaks, and the run ends.
  pool = futures.ProcessPoolExecutor(workers, multiprocessing.get_context('spawn'),
                                     _init_worker, (str(staging),))
  try:
    pending: collections.deque = collections.deque()
    for chunk in chunks:
      pending.append(pool.submit(_tokenize_chunk, chunk))
      if len(pending) >= 2 * workers:  # Bounded: the source is read only as fast as used.
        docs, counts = _result(pending.popleft())
        skipped.update(counts)
        yield from docs
    while pending:
      docs, counts = _result(pending.popleft())
      skipped.update(counts)
      yield from docs
  finally:
    pool.shutdown(cancel_futures=True)


def _result(future: futures.Future):
  """A chunk's result; a worker's failure as one PrepareError (without the worker's traceback
  chained on: the message says it all)."""
  try:
    return future.result()
  except PrepareError as e:
    raise PrepareError(str(e)) from None
  except futures.BrokenExecutor as e:  # A worker died: the pool is broken.
    raise PrepareError(f'a tokenizing worker died ({e}): out of memory, or killed?') from None


_worker_tokenizer: tokenizer_lib.Tokenizer | None = None
_worker_error: str | None = None


def _init_worker(tokenizer_dir: str, threads: bool = False) -> None:
  """Loads the tokenizer; a failure is kept for `_tokenize_chunk` to raise, so that it reaches
  the parent as one error rather than a traceback per worker on stderr."""
  global _worker_tokenizer, _worker_error
  if not threads:  # One thread per worker process: the processes are the parallelism.
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _worker_tokenizer, _worker_error = None, None
  try:
    _worker_tokenizer = tokenizer_lib.Tokenizer.load(tokenizer_dir)
  except Exception as e:  # pylint: disable=broad-except  # Whatever it is, the run ends with it.
    _worker_error = f'{type(e).__name__}: {e}'


def _tokenize_chunk(chunk: list[tuple[str, sources.Document]]
                    ) -> tuple[list[tuple[str, np.ndarray]], dict[str, int]]:
  """Reads (files) and tokenizes one chunk; eos ends every document."""
  if _worker_error is not None:
    raise PrepareError(f'a tokenizing worker failed to start: {_worker_error}')
  tok = _worker_tokenizer
  reader = corpora.TextReader()
  kept, texts = [], []
  for split, doc in chunk:
    text = doc.text if doc.path is None else reader.read(doc.path)
    if text is not None:
      kept.append(split)
      texts.append(text)
  eos = np.array([tok.eos_id], np.int32)
  docs = [(split, np.concatenate([ids.astype(np.int32, copy=False), eos]))
          for split, ids in zip(kept, tok.encode_arrays(texts))]
  for path in reader.binary:
    logging.warning('Skipped binary file %s.', path)
  return docs, {'binary_files': len(reader.binary), 'undecodable_files': len(reader.undecodable)}


def _remove_stale_staging(output: os.PathLike) -> None:
  """Staging directories a killed run left for `output` (stale: the lock is ours)."""
  parent = paths.staging_parent(output)
  if not parent.is_dir():
    return
  for stale in parent.glob(f'.{epath.Path(output).name}{STAGING_MARK}*'):
    logging.warning('Removing %s, left by an interrupted run.', stale)
    shutil.rmtree(stale, ignore_errors=True)


def _commit(staging: pathlib.Path, output: os.PathLike) -> None:
  """Makes `staging` the dataset at `output` (an existing one is replaced).

  Locally a rename. On an object store the files are uploaded, the manifest last: until it
  lands, `shards.open_dataset` finds no dataset there. A replaced dataset's manifest is
  removed first, so no reader takes the old manifest for the new shards.
  """
  if paths.is_url(output):
    output = epath.Path(output)
    (output / shards.MANIFEST_FILENAME).unlink(missing_ok=True)
    paths.remove_tree(output)
    paths.upload_tree(staging, output, last=(shards.MANIFEST_FILENAME,))
    shutil.rmtree(staging, ignore_errors=True)
    return
  if output.exists():
    old = output.with_name(f'.{output.name}.replaced-{os.getpid()}')
    output.rename(old)
    staging.rename(output)
    shutil.rmtree(old, ignore_errors=True)
  else:
    staging.rename(output)
