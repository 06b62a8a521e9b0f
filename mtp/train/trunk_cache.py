"""One pass of a frozen trunk over the training rows: cached states and teacher targets.

Training heads on a pretrained trunk has two costly habits this module removes:
  * with the trunk frozen (Medusa-1), every step would run the same trunk forward over the same
    rows again; `build` runs it once per row and the heads then train on its stored last
    hidden state (`trunk_hidden`), so a step costs only the heads and their output layer;
  * self-distillation (no labelled data) wants the pretrained model's own predictions as
    targets; `build` stores its greedy next token at every position, shifted into a label
    sequence (`targets`) that the loss reads in place of the text. Head k at position t then
    learns the token the trunk itself would emit at t+1+k, which is what greedy verification
    accepts. With the trunk fine-tuned (Medusa-2) these targets keep it close to the base.

Arrays live under `workdir/trunk_cache/<key>/` as `.npy` files opened memory-mapped, written to
a temporary directory and renamed, so an interrupted build leaves nothing half-written. The key
names the rows, the trunk's shape and where its weights came from; another key builds anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

HIDDEN, TARGETS = 'trunk_hidden', 'targets'
_VERSION = 1


def cache_key(arrays: Mapping[str, np.ndarray], trunk_description: str,
              store_hidden: bool) -> str:
  """A short hash of the rows (tokens, segments, positions) and the trunk they go through."""
  digest = hashlib.sha1()
  digest.update(json.dumps({'version': _VERSION, 'trunk': trunk_description,
                            'hidden': store_hidden}, sort_keys=True).encode())
  for name in ('tokens', 'segment_ids', 'positions'):
    digest.update(np.ascontiguousarray(arrays[name]).tobytes())
  return digest.hexdigest()[:16]


def targets_from_predictions(tokens: np.ndarray, predictions: np.ndarray) -> np.ndarray:
  """The label sequence whose token t+1 is the trunk's prediction at t.

  The loss reads head k's label at t as sequence entry t+1+k, so this makes it the trunk's own
  next token at t+k. Entry 0 (never a label) keeps the text's token.

  Args:
    tokens, predictions: [N, T] int32.

  Returns:
    [N, T] int32.
  """
  return np.concatenate([tokens[:, :1], predictions[:, :-1]], axis=1).astype(np.int32)


def build(arrays: Mapping[str, np.ndarray], forward: Callable, directory: str | os.PathLike, *,
          batch_size: int, store_hidden: bool) -> dict[str, np.ndarray]:
  """Runs `forward` over every row once; returns the cached arrays (memory-mapped).

  Args:
    arrays: packed rows, `tokens`, `segment_ids`, `positions` [N, T] int32.
    forward: (tokens, positions, segment_ids) [B, T] -> (hidden [B, T, D] float32, predictions
      [B, T] int32), the frozen trunk's last hidden state and greedy next token.
    directory: the cache directory for this key (created; reused when complete).
    batch_size: rows per forward call (the last call is padded with empty rows).
    store_hidden: keep the hidden states too (frozen trunk), not only the targets.

  Returns:
    {'targets': [N, T] int32} and, if store_hidden, {'trunk_hidden': [N, T, D] float32}.
  """
  directory = pathlib.Path(directory)
  names = [TARGETS] + ([HIDDEN] if store_hidden else [])
  if all((directory / f'{name}.npy').exists() for name in names):
    return load(directory, names)
  tokens = arrays['tokens']
  n, t = tokens.shape
  tmp = directory.with_name(f'{directory.name}.{os.getpid()}.tmp')
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  out = {}
  start = time.perf_counter()
  for first in range(0, n, batch_size):
    rows = slice(first, min(first + batch_size, n))
    batch = [_pad_rows(arrays[k][rows], batch_size) for k in ('tokens', 'positions',
                                                               'segment_ids')]
    hidden, predictions = jax.device_get(forward(*batch))
    if not out:
      out[TARGETS] = np.lib.format.open_memmap(tmp / f'{TARGETS}.npy', 'w+', np.int32, (n, t))
      if store_hidden:
        out[HIDDEN] = np.lib.format.open_memmap(tmp / f'{HIDDEN}.npy', 'w+', np.float32,
                                                (n, t, hidden.shape[-1]))
    count = rows.stop - rows.start
    out[TARGETS][rows] = targets_from_predictions(tokens[rows], predictions[:count])
    if store_hidden:
      out[HIDDEN][rows] = hidden[:count]
    if first == 0 or rows.stop == n or (first // batch_size) % 20 == 0:
      elapsed = time.perf_counter() - start
      logging.info('Trunk pass: %d/%d rows (%.0f tokens/s).', rows.stop, n,
                   rows.stop * t / max(elapsed, 1e-9))
  for array in out.values():
    array.flush()
  del out
  if directory.exists():  # Another process finished first: keep its copy.
    shutil.rmtree(tmp, ignore_errors=True)
  else:
    tmp.replace(directory)
  return load(directory, names)


def load(directory: pathlib.Path, names) -> dict[str, np.ndarray]:
  return {name: np.load(directory / f'{name}.npy', mmap_mode='r') for name in names}


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def trunk_forward(graphdef) -> Callable:
  """A jitted trunk pass for `build`: f(params, tokens, positions, segment_ids).

  Bind the parameters with `functools.partial(f, params)`. Returns the last hidden state
  [B, T, D] float32 and the greedy next token [B, T] int32.
  """
  @jax.jit
  def forward(params, tokens, positions, segment_ids):
    model = nnx.merge(graphdef, params)
    hidden, _ = model.trunk(tokens, positions, segment_ids)
    logits = model.logits(model.trunk.final_norm(hidden))
    return hidden.astype(jnp.float32), jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return forward
