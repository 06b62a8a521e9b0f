"""How much one verification pass of T tokens costs next to T = 1, on the hardware in use.

Speculative decoding pays one forward pass over the whole candidate block per step, so its
speedup is about (tokens accepted per step) / cost(T) / cost(1). That ratio grows very
differently on a CPU (compute-bound early) and on an accelerator (memory-bound: nearly flat up
to dozens of tokens), so the default tree size is chosen from a measured curve:

  * `measure_step_cost` times one cached step (trunk, heads that run in the pass, and the
    logits of every node) for a few T, in a compiled loop so dispatch overhead is left out;
    with `drafting`, the whole drafting step the decode loop runs (the heads drafting a tree
    of T nodes, a branching tree's cache entries moved) against its one-token step, which is
    what the tree choice prices: SmolLM2's EAGLE-3 drafter in bfloat16 at batch 1 drafts a
    chain for 0.18 one-token steps more than verifying it (1.35 against 1.17), and an 8-node
    tree for 0.22 more, so a tree's extra tokens pay less than verification alone says;
  * `step_cost` keeps the relative curve in the measurement cache per (device kind, model
    shape);
  * `choose_tree` picks the tree size that maximises expected tokens per unit of cost, given
    the heads' measured top-k accuracies (`trees.choose_tree_size`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import pathlib
import platform
import time
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.decode import measurements
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.decode import verification
from mtp.model import argmax as argmax_lib
from mtp.model import kv_cache as kv_cache_lib

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32)
# The T a drafting step's cost is measured for first (`drafting_curve`); the rest of
# `DEFAULT_TOKEN_COUNTS` only where the best tree fills them. On a CPU no tree past a few
# nodes pays, and SmolLM2's 16- and 32-token drafting steps took about half of its curve's
# minute to compile and time (AMD EPYC, 2 cores: 31 s for T <= 8).
FIRST_TOKEN_COUNTS = (1, 2, 4, 8)
_TABLE = 'step_cost.json'


# Vector extensions that change which XLA:CPU kernels run, hence a step's cost curve.
_CPU_FEATURES = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16')


# Bumped when decoding's steps change what they cost, so that curves and break-evens measured
# before (`step_cost`, `auto.break_even`) are measured again: 2, the KV cache laid out
# [B, G, S, d] (2026-12-05); 3, trees verified in attention order (`verification`); 4, cache
# chunks read as rows (`kv_cache._chunk`: one-token steps cheaper at batch 4); 5, a tree's
# committed chunks read outside the per-chunk choice of `kv_cache.attend` (trees cheaper); 6,
# greedy verification's argmax in vectorised reductions (`mtp.model.argmax`: blocks cheaper).
STEPS_VERSION = 6


@functools.cache
def cpu_name() -> str:
  """The host CPU's model, vector extensions and usable cores, e.g. 'AMD EPYC avx2 2 cores'.

  XLA:CPU's kind is 'cpu' on every CPU, but curves measured on one CPU do not hold on another:
  SmolLM2's trunk ran 650 tokens/s on one 2-core machine (AVX-512, AMX) and 120 on another
  (AVX2 only).
  """
  cores = _usable_cpus()
  fields = _cpuinfo()
  if fields is None:
    return f'{platform.processor() or platform.machine()} {cores} cores'
  flags = set(fields.get('flags', '').split())
  features = [f for f in _CPU_FEATURES if f in flags]
  return ' '.join([fields.get('model name', platform.machine()), *features, f'{cores} cores'])


def _usable_cpus() -> int:
  """The CPUs this process may run on (XLA:CPU sizes its thread pool by them), at least 1."""
  if hasattr(os, 'sched_getaffinity'):
    return max(1, len(os.sched_getaffinity(0)))
  return os.cpu_count() or 1


@functools.cache
def _cpuinfo() -> dict[str, str] | None:
  """The last CPU's fields in /proc/cpuinfo (None where there is none)."""
  try:
    lines = pathlib.Path('/proc/cpuinfo').read_text().splitlines()
  except OSError:
    return None
  fields = dict(line.split(':', 1) for line in lines if ':' in line)
  return {k.strip(): v.strip() for k, v in fields.items()}


# CPU extensions that multiply bfloat16 in hardware (XLA:CPU's bfloat16 products use them).
_NATIVE_BFLOAT16 = ('avx512_bf16', 'amx_bf16')


def native_bfloat16(platform_name: str | None = None, cpu_flags: str | None = None) -> bool:
  """Whether this machine multiplies bfloat16 in hardware: an accelerator, or a CPU with
  AVX512-BF16 or AMX (`cpu_flags`: its /proc/cpuinfo flags, read when None). Elsewhere a
  bfloat16 step costs far more than float32's: 1.76x a one-token step on an AVX2-only CPU."""
  platform_name = platform_name or jax.devices()[0].platform
  if platform_name != 'cpu':
    return True
  if cpu_flags is None:
    cpu_flags = (_cpuinfo() or {}).get('flags', '')
  return any(f in cpu_flags.split() for f in _NATIVE_BFLOAT16)


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


def _drafted_tree(num_nodes: int, num_heads: int) -> trees_lib.Tree:
  """A tree of num_nodes nodes shaped as `choose_tree`'s are (deepest along the top-1 path,
  siblings near the root), no deeper than the heads: what a drafting step's cost is timed on."""
  accuracies = [[0.6 * 0.3 ** r for r in range(num_nodes)]] * num_heads
  return trees_lib.tree_from_accuracies(accuracies, num_nodes)


@functools.partial(jax.jit, static_argnames=('graphdef', 'num_tokens', 'batch_size',
                                             'context', 'iterations', 'drafting', 'block'))
def _timed_loop(graphdef, params, vocab_ids=None, *, num_tokens: int, batch_size: int,
                context: int, iterations: int, drafting: bool = False,
                block: trees_lib.Tree | None = None):
  """`iterations` steps over a tree of num_tokens nodes (`block`, if given, else a binary
  tree) after `context` committed slots: its verification pass and every node's logits; with
  `drafting` (and T > 1), the rest of a drafting step as the decode loop runs it
  (`loop._drafting_step`) on a tree shaped as the heads' (`_drafted_tree`, not
  `_binary_tree`): a branching tree's accepted entries moved into place, then the heads
  drafting every node from the accepted run (`MTPModel.draft_tree`, over the ids `vocab_ids`
  [N], or the whole vocabulary where None); every step accepts the tree's first deepest path.
  With `drafting`, T = 1 is the loop's one-token step, which runs no heads."""
  model = nnx.merge(graphdef, params)
  b = batch_size
  drafts = drafting and num_tokens > 1
  tree = _drafted_tree(num_tokens, model.mtp_num_heads) if drafts else (
      _binary_tree(num_tokens) if block is None else block)
  depth = tree.max_depth
  cache = model.init_cache(b, context + num_tokens + depth + 1)
  lengths = jnp.full((b,), context, jnp.int32)
  positions = lengths[:, None] + jnp.asarray(tree.depth)[None, :]
  path = jnp.broadcast_to(jnp.asarray(tree.node_paths[int(np.argmax(tree.depth))]),
                          (b, depth + 1))
  vocab = model.draft_vocab(vocab_ids) if drafts and vocab_ids is not None else None

  def body(_, carry):
    tokens, cache = carry
    out, cache, slot = verification.step(model, tree, tokens, positions, cache, lengths,
                                         with_heads=drafts or not drafting)
    # Verification needs every node's logits; feeding their argmax (or the drafts made from
    # them) back means no iteration can be hoisted or skipped.
    chosen = argmax_lib.argmax(model.logits(out.normed))
    if not drafts:
      return chosen, cache
    if not tree.is_chain:
      cache = kv_cache_lib.compact_layers(cache, lengths, path if slot is None else slot[path],
                                          model.num_verified_cache_layers)
    features = jax.tree.map(lambda f: jnp.take_along_axis(
        f, path.reshape(path.shape + (1,) * (f.ndim - 2)), axis=1), out.features)
    # The run's tokens (root, path, the trunk's next token), then the heads' scratch columns.
    run = jnp.pad(jnp.take_along_axis(chosen, path, axis=1), ((0, 0), (0, 1 + depth)))
    drafted, cache = model.draft_tree(features, run, jnp.full((b,), depth, jnp.int32), cache,
                                      lengths, tree, vocab=vocab)
    return drafted.tokens.astype(jnp.int32).at[:, 0].set(chosen[:, 0]), cache

  tokens = jnp.zeros((b, num_tokens), jnp.int32)
  tokens, _ = jax.lax.fori_loop(0, iterations, body, (tokens, cache))
  return tokens


def measure_step_cost(model, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, *,
                      batch_size: int = 1, drafting: bool = False, draft_vocab_size: int = 0,
                      context: int = 256, iterations: int = 16, repeats: int = 5,
                      blocks: Mapping[int, trees_lib.Tree] | None = None) -> dict[int, float]:
  """Seconds per cached verification step over a tree of T new tokens (`_binary_tree`, or
  `blocks[T]`), for each T in token_counts; with `drafting`, per whole drafting step
  (`_timed_loop`).

  Args:
    model: an `MTPModel`.
    token_counts: the T to measure.
    batch_size: rows per step.
    drafting: time the step's drafting too (a model with heads), and T = 1 as the loop's
      one-token step.
    draft_vocab_size: with `drafting`, N > 0: the heads draft over N ids (the cost does not
      depend on which), as with a draft vocabulary; 0: over the whole vocabulary.
    context: committed cache slots each new token attends to (capped by max_seq_len).
    iterations: steps per compiled loop (dispatch is paid once per loop).
    repeats: timed loops per T; the fastest counts (least disturbed by other work).
    blocks: {T: a tree of T nodes} to time instead of a binary tree, without `drafting` (a
      decoder's own block: `benchmarks.loop_steps`).

  Returns:
    {T: seconds per step}.
  """
  return step_timer(model, token_counts, batch_size=batch_size, drafting=drafting,
                    draft_vocab_size=draft_vocab_size, context=context, iterations=iterations,
                    repeats=repeats, blocks=blocks)()


def step_timer(model, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, *,
               batch_size: int = 1, drafting: bool = False, draft_vocab_size: int = 0,
               context: int = 256, iterations: int = 16, repeats: int = 5,
               blocks: Mapping[int, trees_lib.Tree] | None = None
               ) -> Callable[[], dict[int, float]]:
  """`measure_step_cost` (the same arguments) as a function that times its programs, compiled
  here once: each call times them all again, {T: seconds per step}."""
  if not token_counts or min(token_counts) < 1:
    raise ValueError(f'token_counts must be positive, got {token_counts}')
  if drafting and model.mtp_num_heads == 0:
    raise ValueError('a model without MTP heads has no drafting step to time')
  blocks = dict(blocks or {})
  if (drafting and blocks) or any(tree.num_nodes != t for t, tree in blocks.items()):
    raise ValueError('blocks must map T to a tree of T nodes, without drafting, got '
                     f'{ {t: tree.num_nodes for t, tree in blocks.items()} }')
  room = max(token_counts) * (2 if drafting else 1)  # Drafting writes past the tree.
  context = max(1, min(context, model.cfg.trunk.max_seq_len - room))
  if state_lib.fuse_by_default(model):  # Decoding's layout (`state.PreparedModel`).
    model = state_lib.cpu_decoding_copy(model)
  graphdef, params = nnx.split(model)
  vocab_ids = (jnp.arange(draft_vocab_size, dtype=jnp.int32)
               if drafting and draft_vocab_size else None)
  counts = sorted(set(int(t) for t in token_counts))
  # Ahead of time: jit would lower each program only when the one before had compiled.
  compiled = compile_side_by_side(
      _timed_loop.lower(graphdef, params, vocab_ids, num_tokens=t, batch_size=batch_size,
                        context=context, iterations=iterations, drafting=drafting,
                        block=blocks.get(t)) for t in counts)
  runs = {t: functools.partial(program, params, vocab_ids)
          for t, program in zip(counts, compiled)}

  def time_rounds() -> dict[int, float]:
    # Round by round, every T once a round: a slower stretch of the machine then slows every
    # T alike instead of the few timed in it. (Timed T after T, two measurements of one
    # model's curve read 1.74 and 1.97 at T = 16, and `choose_tree` picked different trees
    # from them.) The first round also warms up: a slower first run never counts.
    best = dict.fromkeys(runs, float('inf'))
    for _ in range(repeats):
      for t, run in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(run())
        best[t] = min(best[t], time.perf_counter() - start)
    return {t: seconds / iterations for t, seconds in best.items()}
  return time_rounds


def compile_side_by_side(lowered: Iterable[jax.stages.Lowered]) -> list[jax.stages.Compiled]:
  """Each program compiled, several at once (one per CPU this process may use), the next
  lowered meanwhile where `lowered` is a generator: XLA compiles a program on few threads, and
  lowering holds the interpreter. SmolLM2's drafting steps in bfloat16 at T = 1..32 lowered and
  compiled in 38 s so on 2 cores, against 47 s compiling one at a time."""
  with concurrent.futures.ThreadPoolExecutor(_usable_cpus()) as pool:
    return [job.result() for job in [pool.submit(program.compile) for program in lowered]]


# A curve may fall by this fraction from one T to a larger one before it counts as disturbed
# (timing noise on a quiet machine is a few percent).
FALL_TOLERANCE = 0.05
# Measurements of a disturbed curve beyond the first (`step_cost`).
REMEASURES = 2


def _rising(curve: Mapping[int, float]) -> bool:
  """Whether no T costs less than a smaller T, beyond `FALL_TOLERANCE`: verifying more tokens
  does not cost less."""
  costs = [curve[t] for t in sorted(curve)]
  return all(c >= (1 - FALL_TOLERANCE) * max(costs[:i]) for i, c in enumerate(costs) if i)


def relative(costs: Mapping[int, float]) -> dict[int, float]:
  """Costs divided by the cost of T = 1 (which must be present)."""
  if 1 not in costs:
    raise ValueError('the cost curve needs T = 1')
  return {int(t): float(c) / float(costs[1]) for t, c in sorted(costs.items())}


def step_cost(model, *, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
              batch_size: int = 1, drafting: bool = False, draft_vocab_size: int = 0,
              refresh: bool = False, **measure_kwargs) -> dict[int, float]:
  """The relative cost curve {T: cost(T) / cost(1)}, measured once and kept in the measurement
  cache (`measurements.py`, `step_cost.json`), keyed by device kind, model shape, batch size
  and the token counts (and with `drafting`, the heads' configuration and draft vocabulary).
  A curve that falls as T grows is measured again (`REMEASURES`), and a cached one that falls
  is not read; one timed while other processes kept the CPU busy is measured again once the
  machine is quiet (`measurements.lookup`).

  Args:
    model: an `MTPModel`.
    token_counts: the T to measure (1 is always added).
    batch_size: rows per step.
    drafting, draft_vocab_size: as `measure_step_cost`'s: whole drafting steps against the
      loop's one-token step, or verification passes alone.
    refresh: measure again even when cached.
    **measure_kwargs: passed to `measure_step_cost`.
  """
  token_counts = tuple(sorted(set(int(t) for t in token_counts) | {1}))
  key = (f'v{STEPS_VERSION}|{device_kind()}|{model_key(model)}|B{batch_size}'
         f'|T{",".join(map(str, token_counts))}|tree')  # Timed on trees (`_binary_tree`).
  if drafting:
    cfg = getattr(model, 'cfg', model)
    key += f'|drafting-{measurements.digest(repr(cfg))}-N{draft_vocab_size}'

  def valid(entry) -> bool:
    curve = {int(t): float(c) for t, c in entry['relative'].items()}
    return (set(curve) == set(token_counts) and all(c > 0 for c in curve.values())
            and _rising(curve))

  cached = None if refresh else measurements.lookup(_TABLE, key, valid)
  if cached is not None:
    return {int(t): float(c) for t, c in cached['relative'].items()}
  measure = step_timer(model, token_counts, batch_size=batch_size, drafting=drafting,
                       draft_vocab_size=draft_vocab_size, **measure_kwargs)
  watch = measurements.OtherWork()
  seconds = measure()
  # A curve that falls was disturbed (other work on the machine slowed some T more than
  # others): measured again, each T's fastest counts. One such curve, kept, made `auto` pick
  # a larger tree at a higher break-even (T = 2 at 1.34x one token, T = 4 at 1.04x).
  for _ in range(REMEASURES):
    if _rising(relative(seconds)):
      break
    again = measure()
    seconds = {t: min(seconds[t], again[t]) for t in seconds}
  counts = sorted(seconds)  # What is left of a fall counts as noise: the curve never falls.
  seconds = dict(zip(counts, np.maximum.accumulate([float(seconds[t]) for t in counts])))
  curve = relative(seconds)
  measurements.store(_TABLE, key, measurements.note_load(
      {'relative': {str(t): c for t, c in curve.items()},
       'seconds': {str(t): c for t, c in seconds.items()}},
      watch, f'the cost curve of {"drafting" if drafting else "verification"} steps at batch '
      f'{batch_size}'))
  return curve


def drafting_curve(model, accuracies, *, batch_size: int = 1, draft_vocab_size: int = 0
                   ) -> dict[int, float]:
  """`step_cost`'s curve of whole drafting steps, measured as far as a tree for these
  accuracies could use it: over `FIRST_TOKEN_COUNTS`, and over every T of
  `DEFAULT_TOKEN_COUNTS` where the best tree on that curve has its largest T's nodes (an
  accelerator's flat curve)."""
  kwargs = dict(batch_size=batch_size, drafting=True, draft_vocab_size=draft_vocab_size)
  curve = step_cost(model, token_counts=FIRST_TOKEN_COUNTS, **kwargs)
  if accuracies is not None and (choose_tree(model, accuracies, cost=curve).num_nodes
                                 >= max(curve)):
    curve = step_cost(model, token_counts=DEFAULT_TOKEN_COUNTS, **kwargs)
  return curve


def choose_tree(model, accuracies=None, *, cost: Mapping[int, float] | None = None,
                candidates: Sequence[int] | None = None) -> trees_lib.Tree:
  """The default candidate tree for `model` on the hardware in use.

  Args:
    model: an `MTPModel` with heads.
    accuracies: [depth, R] measured top-k accuracies of heads 1..depth (entry [d, r]: the rank-r
      candidate of head d + 1 is right, given the earlier drafts were); rows past the model's
      heads are dropped. None: no measurements, so a chain of every head's top-1.
    cost: relative cost curve {T: cost(T) / cost(1)} of a step over T tokens; None:
      `drafting_curve(model, accuracies)` (whole drafting steps, measured once per device
      kind and model, then read from the cache).
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
    cost = drafting_curve(model, acc)
  most = sum(acc.shape[1] ** d for d in range(1, acc.shape[0] + 1)) + 1
  if candidates is None:
    candidates = range(2, max(cost) + 1)
  candidates = [n for n in candidates if 2 <= n <= min(most, max(cost))]
  if not candidates:
    raise ValueError(f'no tree size to choose from: the cost curve covers T <= {max(cost)}')
  return trees_lib.tree_from_accuracies(acc, trees_lib.choose_tree_size(acc, cost, candidates))
