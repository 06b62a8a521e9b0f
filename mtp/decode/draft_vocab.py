"""Draft vocabularies (FR-Spec, Zhao et al. 2025): the N most frequent token ids of the data.

Drafting projects the heads' features onto the output layer's rows of these N ids only (a
[N, D] gather instead of the whole [V, D] matrix) and maps the drafted indices back to full
ids. Verification still scores the full vocabulary, so decoding stays exact: a draft
vocabulary changes which tokens can be drafted, never which are emitted.

Frequencies come from the training split of the model's corpus (`corpus_counts`), counted
once and kept in the measurement cache. Everything here is numpy on the host, except `mask_ids`
and `to_full_ids`, which run inside the decode loop.
"""

from __future__ import annotations

import logging
import numbers
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp.data import tokenizer as tokenizer_lib

_CHUNK_TOKENS = 1 << 22  # Tokens per read when counting a streamed (prepared) dataset.


def count_tokens(token_arrays: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
  """Occurrences of every id in [0, vocab_size) over some token arrays.

  Args:
    token_arrays: integer arrays of any shape (ids outside [0, vocab_size) are an error).
    vocab_size: V.

  Returns:
    [V] int64 counts.
  """
  counts = np.zeros(vocab_size, np.int64)
  for tokens in token_arrays:
    tokens = np.asarray(tokens).reshape(-1)
    if not tokens.size:
      continue
    if not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f'token arrays must hold integer ids, got dtype {tokens.dtype}')
    if tokens.min() < 0 or tokens.max() >= vocab_size:
      bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
      raise ValueError(f'token id {int(bad)} is outside the vocabulary [0, {vocab_size})')
    counts += np.bincount(tokens, minlength=vocab_size).astype(np.int64)
  return counts


def check_size(n, vocab_size: int, name: str = 'draft_vocab') -> int:
  """`n` as an int in [1, vocab_size]; ValueError naming `name` otherwise."""
  if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= vocab_size:
    raise ValueError(f'{name} must be an integer in [1, {vocab_size}] (the vocabulary size), '
                     f'got {n!r}')
  return int(n)


def top_ids(counts: np.ndarray, n: int, excluded: Sequence[int] = (),
            limit: int | None = None) -> np.ndarray:
  """The draft vocabulary: the n most frequent ids, most frequent first, ties by lower id.

  Args:
    counts: [V] non-negative occurrences per id.
    n: size of the draft vocabulary, in [1, V].
    excluded: ids that decoding never emits (a pad id): ranked last, after every other id.
    limit: ids >= limit are never emitted either (None: all V may be); ranked last too.

  Returns:
    [n] int32 distinct ids.
  """
  counts = np.asarray(counts)
  if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer) or np.any(counts < 0):
    raise ValueError(f'counts must be [V] non-negative integers, got {counts.dtype} '
                     f'{counts.shape}')
  vocab_size = counts.shape[0]
  n = check_size(n, vocab_size)
  never = np.zeros(vocab_size, bool)
  never[list(excluded)] = True
  if limit is not None:
    never[limit:] = True
  ids = np.arange(vocab_size)
  # lexsort: the last key is the primary one. Emittable first, then by count down, then by id.
  order = np.lexsort((ids, -counts.astype(np.int64), never))
  return order[:n].astype(np.int32)


def check_ids(ids, size: int, vocab_size: int) -> np.ndarray:
  """A draft vocabulary given to the decoder: [size] distinct int ids in [0, vocab_size).

  Returns the ids as an int32 numpy array; ValueError naming what is wrong otherwise.
  """
  ids = np.asarray(ids)
  if ids.shape != (size,) or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(f'draft_vocab must be [{size}] integer ids (the request\'s '
                     f'draft_vocab_size), got {ids.dtype} {ids.shape}')
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f'draft_vocab ids must lie in [0, {vocab_size}), got '
                     f'[{int(ids.min())}, {int(ids.max())}]')
  if np.unique(ids).size != ids.size:
    raise ValueError('draft_vocab ids must be distinct')
  return ids.astype(np.int32)


# ------------------------------------------------------------------------------------------
# Inside the decode loop.
# ------------------------------------------------------------------------------------------


def to_full_ids(index: jax.Array, ids: jax.Array | None) -> jax.Array:
  """Indices into a draft vocabulary (any shape) -> token ids; unchanged without one."""
  return index if ids is None else jnp.take(ids, index, axis=0)


def mask_ids(logits: jax.Array, ids: jax.Array, vocab_limit: int | None,
             banned_ids: tuple[int, ...]) -> jax.Array:
  """Draft logits [..., N] over `ids` [N], with ids never emitted at -inf (as
  `sampling.mask_vocab` does over the full vocabulary)."""
  if vocab_limit is None and not banned_ids:
    return logits
  allowed = ids < (vocab_limit if vocab_limit is not None else jnp.iinfo(jnp.int32).max)
  if banned_ids:
    allowed &= ~jnp.isin(ids, jnp.asarray(banned_ids, ids.dtype))
  return jnp.where(allowed, logits, -jnp.inf)


# ------------------------------------------------------------------------------------------
# A model's draft vocabulary, from its workdir.
# ------------------------------------------------------------------------------------------


def draft_vocabulary(loaded, size: int) -> np.ndarray:
  """[size] int32 token ids: a loaded model's draft vocabulary of that size (FR-Spec).

  The heads' own draft vocabulary where the workdir keeps one of that size (training or
  import wrote it: `checkpointing.save_draft_ids`), in its order. Otherwise the `size` most
  frequent ids of the training split of the workdir's corpus (most frequent first; ties by id),
  ids the model never emits (the pad id, ids past the tokenizer's) last.
  """
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  vocab_size = loaded.model.cfg.trunk.vocab_size
  if getattr(loaded, 'workdir', None) is not None:
    saved = checkpointing.load_draft_ids(loaded.workdir, vocab_size)
    if saved is not None and saved.shape[0] == size:
      return saved
  return corpus_draft_vocabulary(loaded.config, loaded.tokenizer, vocab_size, size,
                                 loaded.workdir)


def corpus_draft_vocabulary(config, tokenizer, vocab_size: int, size: int, workdir=None,
                            name: str = 'draft_vocab') -> np.ndarray:
  """[size] int32: the `size` most frequent ids of `config.data`'s training split, ids never
  emitted last (`draft_vocabulary`). Training (`mtp_head_draft_vocab`) and decoding count the
  same corpus, so heads trained on a draft vocabulary draft over the same ids."""
  check_size(size, vocab_size, name)
  counts = corpus_counts(config, tokenizer, vocab_size, workdir)
  limit, banned = tokenizer_lib.emittable(tokenizer, vocab_size)
  return top_ids(counts, size, excluded=banned, limit=limit)


def corpus_counts(config, tokenizer, vocab_size: int, workdir=None,
                  refresh: bool = False) -> np.ndarray:
  """[vocab_size] int64 token counts of the training split of `config.data`'s corpus, counted
  once and kept in the measurement cache (`measurements.py`), keyed by the corpus and the
  tokenizer.

  The corpus is a prepared dataset (`data.source`) or files read and packed as training reads
  them (`pipeline.load_or_build_split`; `workdir`'s packed cache in `data_cache` is reused when
  training left one). For an imported pretrained model that is the corpus its config names (the
  heads' training data). Padding is not counted. A cached array that does not fit the
  vocabulary is named in a warning and counted again.
  """
  from mtp.decode import measurements  # pylint: disable=import-outside-toplevel
  name = 'token_counts/' + measurements.digest(
      config.data.to_dict() if hasattr(config.data, 'to_dict') else dict(config.data),
      tokenizer.to_json() if hasattr(tokenizer, 'to_json') else repr(tokenizer),
      vocab_size) + '.npy'
  if not refresh:
    counts = measurements.read_array(name)
    if counts is not None:
      if (counts.shape == (vocab_size,) and counts.dtype == np.int64
          and not np.any(counts < 0) and counts.sum()):
        return counts
      logging.warning('Ignoring the token-count cache %s (expected [%d] non-negative int64 '
                      'counts, not all zero; got %s %s); counting again.',
                      measurements.root() / name, vocab_size, counts.dtype, counts.shape)
  counts = _corpus_counts(workdir, config, tokenizer, vocab_size)
  measurements.write_array(name, counts)
  return counts


def _corpus_counts(workdir, config, tokenizer, vocab_size: int) -> np.ndarray:
  return count_tokens(corpus_tokens(config, tokenizer, workdir), vocab_size)


def corpus_tokens(config, tokenizer, workdir=None,
                  max_tokens: int | None = None) -> Iterable[np.ndarray]:
  """The training split of `config.data`'s corpus as token arrays (padding left out), in
  order, up to about `max_tokens` (None: all): a prepared dataset read a chunk at a time, or
  the files packed as training packs them."""
  from mtp.checkpoint import paths
  from mtp.data import pipeline
  from mtp.data import shards
  data = config.data
  if data.get('source'):
    reader = shards.open_dataset(data.source).split('train')
    end = reader.num_tokens if max_tokens is None else min(reader.num_tokens, max_tokens)
    for start in range(0, end, _CHUNK_TOKENS):
      yield from reader.pieces(start, min(start + _CHUNK_TOKENS, end))
    return
  cache = (paths.local_dir(workdir, 'data_cache') if workdir is not None
           else paths.host_cache_root() / 'data_cache')
  arrays = pipeline.load_or_build_split(data, tokenizer, 'train', cache)
  tokens = arrays['tokens'][arrays['segment_ids'] != 0]
  yield tokens if max_tokens is None else tokens[:max_tokens]
