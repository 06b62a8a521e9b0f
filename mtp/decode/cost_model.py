"""How much one verification pass of T tokens costs next to T = 1, on the hardware in use.

Speculative decoding pays one forward pass over the whole candidate block per step, so its
speedup is about (tokens accepted per step) / cost(T) / cost(1). That ratio grows very
differently on a CPU (compute-bound early) and on an accelerator (memory-bound: nearly flat up
to dozens of tokens), so the default tree size is chosen from a measured curve:

  * `measure_step_cost` times one cached step (trunk, heads that run in the pass, and the
    logits of every node) for a few T, in a compiled loop so dispatch overhead is left out;
  * `step_cost` keeps the relative curve in the measurement cache per (device kind, model
    shape);
  * `choose_tree` picks the tree size that maximises expected tokens per unit of cost, given
    the heads' measured top-k accuracies (`trees.choose_tree_size`).
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.decode import measurements
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.model import transformer

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32)
_TABLE = 'step_cost.json'


# Vector extensions that change which XLA:CPU kernels run, hence a step's cost curve.
_CPU_FEATURES = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16')


@functools.cache
def cpu_name() -> str:
  """The host CPU's model, vector extensions and usable cores, e.g. 'AMD EPYC avx2 2 cores'.

  XLA:CPU's kind is 'cpu' on every CPU, but curves measured on one CPU do not hold on another:
  SmolLM2's trunk ran 650 tokens/s on one 2-core machine (AVX-512, AMX) and 120 on another
  (AVX2 only).
  """
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  try:
    lines = pathlib.Path('/proc/cpuinfo').read_text().splitlines()
  except OSError:
    return f'{platform.processor() or platform.machine()} {cores} cores'
  fields = dict(line.split(':', 1) for line in lines if ':' in line)  # The last CPU's values.
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  flags = set(fields.get('flags', '').split())
  features = [f for f in _CPU_FEATURES if f in flags]
  return ' '.join([fields.get('model name', platform.machine()), *features, f'{cores} cores'])


def device_kind() -> str:
  """Platform and kind of the default device, e.g. 'gpu:NVIDIA H200' or, on a CPU, its name
  (`cpu_name`), e.g. 'cpu:AMD EPYC avx2 2 cores'."""
  device = jax.devices()[0]
  kind = cpu_name() if device.platform == 'cpu' else device.device_kind
  return f'{device.platform}:{kind}'


def model_key(model) -> str:
  """A string naming everything about the model's shape that changes a step's cost (a model,
  or its `ModelConfig`)."""
  cfg = getattr(model, 'cfg', model)
  c = cfg.trunk
  return (f'V{c.vocab_size}-D{c.embed_dim}-L{c.num_layers}-H{c.num_attention_heads}'
          f'-KV{c.num_kv_heads}'
          f'-hd{c.head_dim}-mlp{c.mlp_dim}-{c.dtype}-{cfg.mtp_head_type}'
          f'{cfg.mtp_num_heads}')


def _binary_tree(num_nodes: int) -> trees_lib.Tree:
  """A balanced binary tree of num_nodes nodes, root included (node i's parent (i - 1) // 2).
  Steps are timed on a tree, not a chain: in half precision on CPU a tree's attention reads
  its nodes' ancestors in logical order, which a chain does not need (`kv_cache`)."""
  paths = [()]
  for node in range(1, num_nodes):
    paths.append(paths[(node - 1) // 2] + ((node - 1) % 2,))
  return trees_lib.tree_from_choices(paths[1:])


@functools.partial(jax.jit, static_argnames=('graphdef', 'num_tokens', 'batch_size',
                                             'context', 'iterations'))
def _timed_loop(graphdef, params, *, num_tokens: int, batch_size: int, context: int,
                iterations: int):
  """`iterations` verification passes of a tree of num_tokens nodes (`_binary_tree`) after
  `context` committed slots."""
  model = nnx.merge(graphdef, params)
  cache = model.init_cache(batch_size, context + num_tokens)
  lengths = jnp.full((batch_size,), context, jnp.int32)
  tree = _binary_tree(num_tokens)
  positions = lengths[:, None] + jnp.asarray(tree.depth)[None, :]

  def body(_, carry):
    tokens, cache = carry
    out, cache = model.step(tokens, positions, cache, lengths, jnp.asarray(tree.attention_mask))
    logits = model.logits(out.normed)  # Verification needs every node's logits.
    # Feed the argmax back so no iteration can be hoisted or skipped.
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

  tokens = jnp.zeros((batch_size, num_tokens), jnp.int32)
  tokens, _ = jax.lax.fori_loop(0, iterations, body, (tokens, cache))
  return tokens


def measure_step_cost(model, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, *,
                      batch_size: int = 1, context: int = 256, iterations: int = 16,
                      repeats: int = 5) -> dict[int, float]:
  """Seconds per cached verification step over a tree of T new tokens (`_binary_tree`), for each
  T in token_counts.

  Args:
    model: an `MTPModel`.
    token_counts: the T to measure.
    batch_size: rows per step.
    context: committed cache slots each new token attends to (capped by max_seq_len).
    iterations: steps per compiled loop (dispatch is paid once per loop).
    repeats: timed loops per T; the fastest counts (least disturbed by other work).

  Returns:
    {T: seconds per step}.
  """
  if not token_counts or min(token_counts) < 1:
    raise ValueError(f'token_counts must be positive, got {token_counts}')
  context = max(1, min(context, model.cfg.trunk.max_seq_len - max(token_counts)))
  if state_lib.fuse_by_default(model):  # Decoding's layout (`state.PreparedModel`).
    model = transformer.fused_projections(model)
  graphdef, params = nnx.split(model)
  costs = {}
  for t in sorted(set(int(t) for t in token_counts)):
    run = functools.partial(_timed_loop, graphdef, params, num_tokens=t,
                            batch_size=batch_size, context=context, iterations=iterations)
    jax.block_until_ready(run())  # Compile and warm up.
    best = float('inf')
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(run())
      best = min(best, time.perf_counter() - start)
    costs[t] = best / iterations
  return costs


def relative(costs: Mapping[int, float]) -> dict[int, float]:
  """Costs divided by the cost of T = 1 (which must be present)."""
  if 1 not in costs:
    raise ValueError('the cost curve needs T = 1')
  return {int(t): float(c) / float(costs[1]) for t, c in sorted(costs.items())}


def step_cost(model, *, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
              batch_size: int = 1, refresh: bool = False, **measure_kwargs) -> dict[int, float]:
  """The relative cost curve {T: cost(T) / cost(1)}, measured once and kept in the measurement
  cache (`measurements.py`, `step_cost.json`), keyed by device kind, model shape, batch size
  and the token counts.

  Args:
    model: an `MTPModel`.
    token_counts: the T to measure (1 is always added).
    batch_size: rows per step.
    refresh: measure again even when cached.
    **measure_kwargs: passed to `measure_step_cost`.
  """
  token_counts = tuple(sorted(set(int(t) for t in token_counts) | {1}))
  key = (f'{device_kind()}|{model_key(model)}|B{batch_size}|T{",".join(map(str, token_counts))}'
         '|tree')  # Timed on trees since 2026-12-03 (`_binary_tree`): older chain entries differ.

  def valid(entry) -> bool:
    curve = {int(t): float(c) for t, c in entry['relative'].items()}
    return set(curve) == set(token_counts) and all(c > 0 for c in curve.values())

  cached = None if refresh else measurements.lookup(_TABLE, key, valid)
  if cached is not None:
    return {int(t): float(c) for t, c in cached['relative'].items()}
  seconds = measure_step_cost(model, token_counts, batch_size=batch_size, **measure_kwargs)
  curve = relative(seconds)
  measurements.store(_TABLE, key, {'relative': {str(t): c for t, c in curve.items()},
                                   'seconds': {str(t): c for t, c in seconds.items()}})
  return curve


def choose_tree(model, accuracies=None, *, cost: Mapping[int, float] | None = None,
                candidates: Sequence[int] | None = None) -> trees_lib.Tree:
  """The default candidate tree for `model` on the hardware in use.

  Args:
    model: an `MTPModel` with heads.
    accuracies: [depth, R] measured top-k accuracies of heads 1..depth (entry [d, r]: the rank-r
      candidate of head d + 1 is right, given the earlier drafts were); rows past the model's
      heads are dropped. None: no measurements, so a chain of every head's top-1.
    cost: relative cost curve {T: cost(T) / cost(1)}; None: `step_cost(model)` (measured
      once per device kind and model shape, then read from the cache).
    candidates: tree sizes (nodes, root included) to consider; default every size the cost
      curve covers, from 2 up.

  Returns:
    The tree with the best expected tokens per unit of verification cost.
  """
  num_heads = model.mtp_num_heads
  if num_heads == 0:
    raise ValueError('a model without MTP heads has no candidate tree')
  if accuracies is None:
    return trees_lib.chain_tree(num_heads)
  acc = np.asarray(accuracies, np.float64)
  if acc.ndim != 2:
    raise ValueError(f'accuracies must be [num_heads, top_k], got shape {acc.shape}')
  acc = acc[:num_heads]
  if cost is None:
    cost = step_cost(model)
  most = sum(acc.shape[1] ** d for d in range(1, acc.shape[0] + 1)) + 1
  if candidates is None:
    candidates = range(2, max(cost) + 1)
  candidates = [n for n in candidates if 2 <= n <= min(most, max(cost))]
  if not candidates:
    raise ValueError(f'no tree size to choose from: the cost curve covers T <= {max(cost)}')
  return trees_lib.tree_from_accuracies(acc, trees_lib.choose_tree_size(acc, cost, candidates))
