"""One pass of a frozen trunk over the training rows: cached states and teacher targets.

Training heads on a pretrained trunk has two costly habits and one mismatch, which this module
removes:
  * with the trunk frozen (Medusa-1), every step would run the same trunk forward over the same
    rows again; `build` runs it once per row and the heads then train on its stored last
    hidden state (`trunk_hidden`), and on the inputs of the trunk layers their family reads
    (`trunk_layer_inputs`, `HeadFamily.trunk_layer_inputs`, e.g. Speculative Streaming's
    streamed layers), so a step costs only the heads and their output layer;
  * self-distillation (no labelled data) wants the pretrained model's own predictions as
    targets; `build` stores its greedy next token at every position, shifted into a label
    sequence (`targets`) that the loss reads in place of the text. Head k at position t then
    learns the token the trunk itself would emit at t+1+k, which is what greedy verification
    accepts. With the trunk fine-tuned (Medusa-2) these targets keep it close to the base.
  * that target is still conditioned on the text's own tokens before t+1+k, which decoding only
    sees where the trunk would have written them itself. `build_rollouts` removes the mismatch:
    rows become a prompt cut from the text plus the trunk's greedy continuation, generated with
    a KV cache, their hidden states kept on the way (Medusa's self-distillation).

Arrays live under `workdir/trunk_cache/<key>/` as `.npy` files opened memory-mapped, written to
a partial directory and renamed when complete, so an interrupted build leaves nothing
half-written, and the next run resumes it at the first row not yet on disk. The key names the
rows, the trunk's shape and where its weights came from; another key builds anew.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from mtp.model import argmax as argmax_lib

HIDDEN, TARGETS, HEAD_MASK = 'trunk_hidden', 'targets', 'head_mask'
LAYER_INPUTS = 'trunk_layer_inputs'
_VERSION = 2


def cache_key(arrays: Mapping[str, np.ndarray], trunk_description: str,
              store_hidden: bool, layers: Sequence[int] = ()) -> str:
  """A short hash of the input rows (every array given), of the trunk they go through and of
  what is kept of it (the last hidden state; the inputs of `layers`)."""
  digest = hashlib.sha1()
  kept = {'version': _VERSION, 'trunk': trunk_description, 'hidden': store_hidden}
  if layers:  # Absent otherwise: caches built before layer inputs keep their keys.
    kept['layer_inputs'] = list(layers)
  digest.update(json.dumps(kept, sort_keys=True).encode())
  for name in sorted(arrays):
    digest.update(name.encode())
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


def stored_names(store_hidden: bool, store_layer_inputs: bool) -> list[str]:
  """The trunk states a cache keeps besides its rows and targets."""
  return ([HIDDEN] if store_hidden else []) + ([LAYER_INPUTS] if store_layer_inputs else [])


def build(arrays: Mapping[str, np.ndarray], forward: Callable, directory: str | os.PathLike, *,
          batch_size: int, store_hidden: bool, store_layer_inputs: bool = False
          ) -> dict[str, np.ndarray]:
  """Runs `forward` over every row once; returns the cached arrays (memory-mapped).

  Args:
    arrays: packed rows, `tokens`, `segment_ids`, `positions` [N, T] int32.
    forward: (tokens, positions, segment_ids) [B, T] -> (hidden [B, T, D] float32, layer
      inputs [B, T, M, D] float32, predictions [B, T] int32): the frozen trunk's last hidden
      state, the inputs of the M layers `trunk_forward` was given, and its greedy next token.
    directory: the cache directory for this key (created; reused when complete).
    batch_size: rows per forward call (the last call is padded with empty rows).
    store_hidden: keep the hidden states too (frozen trunk), not only the targets.
    store_layer_inputs: keep the layer inputs too.

  Returns:
    {'targets': [N, T] int32}; if store_hidden, {'trunk_hidden': [N, T, D] float32}; if
    store_layer_inputs, {'trunk_layer_inputs': [N, T, M, D] float32}.
  """
  names = [TARGETS] + stored_names(store_hidden, store_layer_inputs)
  tokens = arrays['tokens']

  def compute(rows: slice) -> dict[str, np.ndarray]:
    batch = [_pad_rows(arrays[k][rows], batch_size) for k in ('tokens', 'positions',
                                                               'segment_ids')]
    hidden, layer_inputs, predictions = jax.device_get(forward(*batch))
    count = rows.stop - rows.start
    out = {TARGETS: targets_from_predictions(tokens[rows], predictions[:count]),
           HIDDEN: hidden[:count], LAYER_INPUTS: layer_inputs[:count]}
    return {name: out[name] for name in names}

  return _build(directory, names, tokens.shape[0], batch_size, compute, 'Trunk pass',
                tokens.shape[1])


def rollout_prompts(arrays: Mapping[str, np.ndarray], prompt_len: int) -> np.ndarray:
  """One prompt per packed row: its first `prompt_len` tokens that lie in a single document.

  Rows without such a window (only short documents) give none.

  Args:
    arrays: packed rows, `tokens` and `segment_ids` [N, T] int32.

  Returns:
    [M, prompt_len] int32, M <= N.
  """
  tokens, segments = np.asarray(arrays['tokens']), np.asarray(arrays['segment_ids'])
  t = tokens.shape[1]
  if not 1 <= prompt_len < t:
    raise ValueError(f'distill.prompt_len must be in [1, seq_len), got {prompt_len} for '
                     f'seq_len {t}.')
  # Segments are contiguous within a row: a window is one document when its ends agree.
  inside = (segments[:, :t - prompt_len + 1] == segments[:, prompt_len - 1:]) & (
      segments[:, :t - prompt_len + 1] != 0)
  rows = np.flatnonzero(inside.any(axis=1))
  starts = inside[rows].argmax(axis=1)
  return np.stack([tokens[r, s:s + prompt_len] for r, s in zip(rows, starts)]).astype(
      np.int32) if len(rows) else np.zeros((0, prompt_len), np.int32)


def build_rollouts(prompts: np.ndarray, rollout: Callable, directory: str | os.PathLike, *,
                   seq_len: int, batch_size: int, store_hidden: bool,
                   store_layer_inputs: bool = False) -> dict[str, np.ndarray]:
  """Rows of the trunk's own greedy continuations of `prompts`, with what training reads.

  Each row is a prompt followed by the trunk's greedy continuation up to `seq_len` tokens, one
  document at positions 0 .. seq_len - 1. There, and only there, a head's target is exactly
  what greedy verification will accept after the same accepted tokens; on human text (`build`)
  the trunk's token at t+1+k is conditioned on the text's tokens before it, which decoding never
  sees wherever the trunk would have chosen differently. The heads' losses count from the last
  prompt token on (`head_mask`): that is where decoding starts to draft.

  Args:
    prompts: [N, P] int32 (`rollout_prompts`).
    rollout: prompts [B, P] -> (tokens [B, seq_len] int32, hidden [B, seq_len, D] float32,
      layer inputs [B, seq_len, M, D] float32, predictions [B, seq_len] int32), see
      `rollout_forward`.
    directory, batch_size, store_hidden, store_layer_inputs: as in `build`.
    seq_len: row length, prompt included.

  Returns:
    `tokens`, `segment_ids`, `positions`, `targets` [N, seq_len] int32, `head_mask` [N,
    seq_len] bool; if store_hidden, `trunk_hidden` [N, seq_len, D] float32; if
    store_layer_inputs, `trunk_layer_inputs` [N, seq_len, M, D] float32.
  """
  n, prompt_len = prompts.shape
  batch_size = min(batch_size, n)  # A few eval rows need no batch of padding.
  names = ['tokens', 'segment_ids', 'positions', TARGETS, HEAD_MASK] + stored_names(
      store_hidden, store_layer_inputs)

  def compute(rows: slice) -> dict[str, np.ndarray]:
    count = rows.stop - rows.start
    tokens, hidden, layer_inputs, predictions = jax.device_get(
        rollout(_pad_rows(prompts[rows], batch_size)))
    shape = (count, seq_len)
    out = {'tokens': tokens[:count],
           'segment_ids': np.ones(shape, np.int32),
           'positions': np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape),
           TARGETS: targets_from_predictions(tokens[:count], predictions[:count]),
           HEAD_MASK: np.broadcast_to(np.arange(seq_len) >= prompt_len - 1, shape),
           HIDDEN: hidden[:count], LAYER_INPUTS: layer_inputs[:count]}
    return {name: out[name] for name in names}

  return _build(directory, names, n, batch_size, compute, 'Greedy rollouts', seq_len)


def _build(directory: str | os.PathLike, names: list[str], num_rows: int, batch_size: int,
           compute: Callable[[slice], dict[str, np.ndarray]], what: str,
           tokens_per_row: int) -> dict[str, np.ndarray]:
  """Fills `names`.npy ([num_rows, ...] each) from `compute(rows)`, batch by batch, atomically.

  The arrays fill `<key>.partial/`, which records after every batch how many rows are written
  (`progress.json`, written once the rows are on disk). A build that is stopped (preempted,
  killed, out of time) resumes there: a pass of the trunk over millions of tokens takes hours
  here. One process at a time owns the partial directory (a lock beside it); another one that
  builds the same key meanwhile builds a private copy from the start, and the first complete
  copy wins.
  """
  directory = pathlib.Path(directory)
  if all((directory / f'{name}.npy').exists() for name in names):
    return load(directory, names)
  directory.parent.mkdir(parents=True, exist_ok=True)
  lock_path = directory.with_name(f'{directory.name}.partial.lock')
  lock = open(lock_path, 'w')
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    tmp, resumable = directory.with_name(f'{directory.name}.partial'), True
  except OSError:  # Another process owns the partial build.
    lock.close()
    lock, resumable = None, False
    tmp = directory.with_name(f'{directory.name}.{os.getpid()}.tmp')
  try:
    if all((directory / f'{name}.npy').exists() for name in names):  # Built meanwhile.
      return load(directory, names)
    out, done = (_reopen(tmp, names, num_rows) if resumable else ({}, 0))
    if done:
      logging.info('%s: resuming at row %d/%d from %s.', what, done, num_rows, tmp)
    else:
      shutil.rmtree(tmp, ignore_errors=True)
      tmp.mkdir(parents=True)
    start, counted = time.perf_counter(), 0
    for first in range(done, num_rows, batch_size):
      rows = slice(first, min(first + batch_size, num_rows))
      values = compute(rows)
      if not out:
        out = {name: np.lib.format.open_memmap(
            tmp / f'{name}.npy', 'w+', values[name].dtype,
            (num_rows,) + values[name].shape[1:]) for name in names}
      for name in names:
        out[name][rows] = values[name]
        out[name].flush()
      _write_progress(tmp, rows.stop, num_rows, names)
      counted += rows.stop - rows.start
      if first == done or rows.stop == num_rows or (first // batch_size) % 20 == 0:
        rate = counted * tokens_per_row / max(time.perf_counter() - start, 1e-9)
        logging.info('%s: %d/%d rows (%.0f tokens/s%s).', what, rows.stop, num_rows, rate,
                     time_left((num_rows - rows.stop) * tokens_per_row / max(rate, 1e-9)))
    del out
    (tmp / _PROGRESS).unlink(missing_ok=True)
    if directory.exists():  # Another process finished first: keep its copy.
      shutil.rmtree(tmp, ignore_errors=True)
    else:
      tmp.replace(directory)
    if resumable:
      lock_path.unlink(missing_ok=True)
  except BaseException:
    if not resumable:  # Nobody resumes a private copy.
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    if lock is not None:
      lock.close()
  return load(directory, names)


_PROGRESS = 'progress.json'


def time_left(seconds: float) -> str:
  """', about N minutes left' (or hours, or seconds) for a progress line; '' when done."""
  if seconds <= 0:
    return ''
  if seconds < 90:
    return f', about {seconds:.0f} s left'
  if seconds < 90 * 60:
    return f', about {seconds / 60:.0f} minutes left'
  return f', about {seconds / 3600:.1f} hours left'


def _write_progress(tmp: pathlib.Path, rows_done: int, num_rows: int, names) -> None:
  staged = tmp / f'{_PROGRESS}.tmp'
  staged.write_text(json.dumps({'rows_done': rows_done, 'num_rows': num_rows,
                                'names': sorted(names)}))
  staged.replace(tmp / _PROGRESS)


def _reopen(tmp: pathlib.Path, names, num_rows: int) -> tuple[dict[str, np.ndarray], int]:
  """The arrays of a partial build and its rows written, or ({}, 0) when there is nothing to
  resume (none, or one of other rows or arrays: a partial build is never trusted half-way)."""
  try:
    progress = json.loads((tmp / _PROGRESS).read_text())
    if progress['num_rows'] != num_rows or progress['names'] != sorted(names):
      return {}, 0
    out = {name: np.load(tmp / f'{name}.npy', mmap_mode='r+') for name in names}
    done = int(progress['rows_done'])
    if not 0 < done <= num_rows or any(a.shape[0] != num_rows for a in out.values()):
      return {}, 0
    return out, done
  except (OSError, ValueError, KeyError, TypeError):
    return {}, 0


def load(directory: pathlib.Path, names) -> dict[str, np.ndarray]:
  return {name: np.load(directory / f'{name}.npy', mmap_mode='r') for name in names}


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _stacked(layer_inputs: Mapping[int, jax.Array], layers: Sequence[int],
             like: jax.Array) -> jax.Array:
  """{i: [B, T, D]} -> [B, T, M, D] float32 in `layers`' order ([B, T, 0, D] for none)."""
  if not layers:
    return jnp.zeros(like.shape[:2] + (0,) + like.shape[2:], jnp.float32)
  return jnp.stack([layer_inputs[i].astype(jnp.float32) for i in layers], axis=2)


def trunk_forward(graphdef, layers: Sequence[int] = ()) -> Callable:
  """A jitted trunk pass for `build`: f(params, tokens, positions, segment_ids).

  Bind the parameters with `functools.partial(f, params)`. Returns the last hidden state
  [B, T, D] float32, the inputs of trunk `layers` [B, T, M, D] float32 and the greedy next
  token [B, T] int32.
  """
  layers = tuple(layers)

  @jax.jit
  def forward(params, tokens, positions, segment_ids):
    model = nnx.merge(graphdef, params)
    hidden, layer_inputs = model.trunk.train_forward(tokens, positions, segment_ids, layers)
    logits = model.logits(model.trunk.final_norm(hidden))
    return (hidden.astype(jnp.float32), _stacked(layer_inputs, layers, hidden),
            argmax_lib.argmax(logits))
  return forward


def rollout_forward(graphdef, seq_len: int, layers: Sequence[int] = ()) -> Callable:
  """A jitted greedy rollout for `build_rollouts`: f(params, prompts [B, P]).

  Bind the parameters with `functools.partial(f, params)`. One prefill of the prompts, then
  seq_len - P cached one-token steps in a `lax.scan`; every step's states are kept, so the
  continuation needs no second trunk pass. Returns tokens [B, seq_len] (prompt, then
  continuation), the last hidden state [B, seq_len, D] float32, the inputs of trunk `layers`
  [B, seq_len, M, D] float32 and the greedy next token [B, seq_len] int32 at every position.
  """
  layers = tuple(layers)

  @jax.jit
  def rollout(params, prompts):
    model = nnx.merge(graphdef, params)
    b, p = prompts.shape
    cache = model.init_cache(b, seq_len)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, layer_inputs, cache = model.trunk.cached_forward(
        prompts, positions, cache, jnp.zeros((b,), jnp.int32), None, layers)
    predictions = argmax_lib.argmax(model.logits(model.trunk.final_norm(hidden)))
    prompt_states = (hidden.astype(jnp.float32), _stacked(layer_inputs, layers, hidden))

    def one_token(carry, position):
      token, cache = carry
      lengths = jnp.full((b,), position, jnp.int32)
      hidden, layer_inputs, cache = model.trunk.cached_forward(
          token[:, None], lengths[:, None], cache, lengths, None, layers)
      following = argmax_lib.argmax(model.logits(model.trunk.final_norm(hidden[:, 0])))
      return (following, cache), (token, hidden[:, 0].astype(jnp.float32),
                                  _stacked(layer_inputs, layers, hidden)[:, 0], following)

    _, (tokens, hidden, inputs, following) = jax.lax.scan(
        one_token, (predictions[:, -1], cache), jnp.arange(p, seq_len, dtype=jnp.int32))
    return (jnp.concatenate([prompts.astype(jnp.int32), tokens.T], axis=1),
            jnp.concatenate([prompt_states[0], jnp.swapaxes(hidden, 0, 1)], 1),
            jnp.concatenate([prompt_states[1], jnp.swapaxes(inputs, 0, 1)], 1),
            jnp.concatenate([predictions, following.T], axis=1))
  return rollout
