"""The decode loop behind every decoder: draft, verify, accept, on device.

Each loop iteration, for every row of the batch at once:
  1. verify: one cached `model.step` over the block [last token, draft_1..draft_N] laid out as
     a candidate tree (`DecodeRequest.tree`; a chain is the tree of top-1 drafts, and a
     root-only tree, nothing drafted, is autoregressive decoding): node n sits at position
     length + depth(n) and attends to its ancestors only (`tree.attention_mask`);
  2. accept: the longest drafted path the trunk agrees with, plus one token of the trunk's own
     (the correction, or the bonus when every draft on the path passes): greedy argmax match or
     exact speculative rejection sampling (`sampling.py`);
  3. cut the accepted tokens exactly where one-token decoding would stop (EOS, max_new_tokens);
  4. keep the KV entries of the accepted path: a chain's accepted prefix is already contiguous;
     a tree's path is moved to the front of the block (`kv_cache.compact`); the rest of the
     block becomes scratch again;
  5. draft the next block from the same pass (`MTPModel.draft_logits`, whatever the head
     family), at the last accepted node. A tree with a lookup chain (`trees.with_lookup`,
     greedy) also copies the tokens that followed the row's last few tokens earlier in its own
     text (`lookup.py`).

All of it, prefill aside, is one jitted `lax.while_loop` over a `LoopState`; rows finish on
their own and stop changing; nothing goes back to the host per step. The model is split with
`nnx.split` on the host and merged inside the jitted functions (as in the google/flax gemma
sampler); pass a `state.PreparedModel` to split once for many calls.

Entry points: `generate` and `generate_chunks` check their input (`request.py`) and decode;
`decode` and `decode_chunks` take an already checked request (callers that check a whole
batch of prompts once, such as `mtp.generate`).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterator

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import draft_vocab as draft_vocab_lib
from mtp.decode import dynamic_trees
from mtp.decode import lookup as lookup_lib
from mtp.decode import request as request_lib
from mtp.decode import row_mapped
from mtp.decode import sampling as sampling_lib
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.model import kv_cache as kv_cache_lib

Array = jax.Array
DecodeResult = state_lib.DecodeResult
DecodeRequest = request_lib.DecodeRequest


@flax.struct.dataclass
class LoopState:
  """The decode loop's carry (N = tree nodes, root included; depth = the tree's depth).

  Attributes:
    tokens: [B, max_new_tokens + depth + 1] output buffer (spare columns: writes never clamp).
    num_generated: [B] tokens in the buffer.
    done: [B] rows that stopped; they no longer change.
    last_token: [B] the newest token (the next block's root), not yet in the cache.
    drafts: [B, N - 1] the next block's drafted nodes, in tree node order (root excluded).
    block_nodes: [B, N] a dynamic tree's (`request.tree_budget`): the superset node of each
      slot of the next block, ascending, root first (`dynamic_trees.select`); [B, 0] else.
    lengths: [B] committed cache slots (= position of last_token).
    num_steps: [B] verification passes that worked on the row.
    histogram: [B, depth + 2] steps per number of tokens emitted.
    cache: the KV cache.
    rng: PRNG key.
    eos_id: [] int32 end-of-sequence id, -1 for none (traced: changing it does not recompile).
    pad_id: [] int32 filler after a row's end.
    context: [B, C] every row's tokens by position, prompt included, for lookup drafts
      (position lengths holds last_token; later columns are stale); [B, 0] without lookup.
    lookup_key: [B] int32 length of the key the pending lookup drafts matched (0: none).
    The next six serve requests that fall back (`DecodeRequest.fallback`, the 'auto'
    decoder). Its drafting steps are of two kinds: 0 verifies the heads' block (the tree
    without its lookup chain), 1 the whole block, lookup chain included (only for a tree with
    one, and only when every active row's lookup key is at least `lookup_min_key` long: the
    whole batch pays for the bigger block). Each kind is accounted apart and stops once it
    stops paying; where neither runs, the loop decodes one token per pass. A stopped kind is
    tried again, with a fresh account and a probe of one step, once enough steps have passed
    that a failed retry loses at most half of `request.FALLBACK_BUDGET` of them (the probe
    has the budget too): acceptance that changes during a generation (a text that starts
    repeating itself) is followed, at a bounded cost.
    pays: [2] bool whether each kind still pays.
    idle: [2] int32 loop steps since each kind stopped (0 while it pays).
    costs: [2] float32 one step of each kind, in one-token steps: its break-even in tokens
      per step (0: never stops).
    block_tokens: [B, 2] int32 tokens each row emitted in each kind's steps.
    block_steps: [B, 2] int32 steps of each kind that worked on each row. A kind is judged on
      the row furthest behind (`judge` in `_run`).
    probe_steps: [2] int32 steps of each kind (per row) before it is first checked.
    lookup_min_key: [] int32 the whole block's lookup key threshold.
    draft_vocab: [N] int32 ids the heads draft over (`DecodeRequest.draft_vocab_size`; traced:
      a new vocabulary of the same size does not recompile); [0] without a draft vocabulary.
  """
  tokens: Array
  num_generated: Array
  done: Array
  last_token: Array
  drafts: Array
  block_nodes: Array
  lengths: Array
  num_steps: Array
  histogram: Array
  cache: kv_cache_lib.KVCache
  rng: Array
  eos_id: Array
  pad_id: Array
  context: Array
  lookup_key: Array
  pays: Array
  idle: Array
  costs: Array
  block_tokens: Array
  block_steps: Array
  probe_steps: Array
  lookup_min_key: Array
  draft_vocab: Array


# ------------------------------------------------------------------------------------------
# Drafting.
# ------------------------------------------------------------------------------------------


def _drafts(request: DecodeRequest, logits: Array | None, context: Array,
            lengths: Array, vocab=None) -> tuple[Array, Array, Array]:
  """Head logits [depth, B, V] (and the lookup chain's copies) -> the next block's drafts.

  N - 1 drafts in tree order, root excluded; `context` and `lengths` (the position of the newest
  token) feed the lookup chain, if the tree has one. A root-only tree drafts nothing. With a
  draft vocabulary `vocab` (`MTPModel.draft_vocab`, M ids), the logits are [depth, B, M] over
  its ids. A dynamic tree (`request.tree_budget` = N) drafts the N nodes of the request's tree
  that the heads' own probabilities rank first, per row.

  Returns:
    (drafts [B, N - 1], lookup key length [B]: 0 without a lookup chain, the block's superset
    nodes [B, N] of a dynamic tree, else [B, 0]).
  """
  tree = request.tree
  b = context.shape[0]
  no_key, no_nodes = jnp.zeros((b,), jnp.int32), jnp.zeros((b, 0), jnp.int32)
  if tree.num_nodes == 1:
    return jnp.zeros((b, 0), jnp.int32), no_key, no_nodes
  if tree.is_chain and not request.tree_budget:
    best = draft_vocab_lib.to_full_ids(jnp.argmax(logits, axis=-1), _ids(vocab))
    return best.T.astype(jnp.int32), no_key, no_nodes
  values, top = jax.lax.top_k(logits, max(tree.topk_per_depth))  # [depth, B, R]
  top = jnp.transpose(draft_vocab_lib.to_full_ids(top, _ids(vocab)), (1, 0, 2))
  copies, key = None, no_key
  if tree.lookup_depth:
    copies, key = lookup_lib.propose_with_key(context, lengths, tree.lookup_depth)
  nodes = trees_lib.draft_tokens_for_tree(tree, top, lookup_tokens=copies)
  if not request.tree_budget:
    return nodes[:, 1:].astype(jnp.int32), key, no_nodes
  log_probs = values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  chosen = dynamic_trees.select(tree, jnp.transpose(log_probs, (1, 0, 2)),
                                request.tree_budget)
  nodes = jnp.take_along_axis(nodes, chosen, axis=1)
  return nodes[:, 1:].astype(jnp.int32), key, chosen


def _compact(cache: kv_cache_lib.KVCache, lengths: Array, path: Array,
             num_layers: int) -> kv_cache_lib.KVCache:
  """`kv_cache.compact` on the first num_layers layers (the ones the verification wrote)."""
  moved = kv_cache_lib.compact(
      kv_cache_lib.KVCache(keys=cache.keys[:num_layers], values=cache.values[:num_layers]),
      lengths, path)
  return kv_cache_lib.KVCache(keys=moved.keys + cache.keys[num_layers:],
                              values=moved.values + cache.values[num_layers:])


# ------------------------------------------------------------------------------------------
# The compiled pieces.
# ------------------------------------------------------------------------------------------


def _sample(rng: Array, logits: Array, request: DecodeRequest) -> Array:
  return sampling_lib.sample_tokens(rng, logits, request.temperature, request.top_k,
                                    request.top_p)


def _logits(model, normed: Array, request: DecodeRequest) -> Array:
  """The trunk's logits [..., V] over the ids this request may emit."""
  return _mask(model.logits(normed), request)


def _mask(logits: Array, request: DecodeRequest) -> Array:
  return sampling_lib.mask_vocab(logits, request.vocab_limit, request.banned_ids)


def _head_logits(model, request: DecodeRequest, features, tokens: Array, last_index: Array,
                 cache: kv_cache_lib.KVCache, lengths: Array, vocab=None):
  """`model.draft_logits` for the tree's heads (over the draft vocabulary `vocab` of M ids,
  if any: logits [depth, B, M]); (None, cache) when no head drafts."""
  if not request.tree.head_depth:
    return None, cache
  depth = request.tree.head_depth
  b = tokens.shape[0]
  # Columns after the run: the heads' own drafts are written there in turn (sequential).
  tokens = jnp.concatenate([tokens, jnp.zeros((b, depth), tokens.dtype)], axis=1)
  if vocab is None:
    logits, cache = model.draft_logits(features, tokens, last_index, cache, lengths, depth)
    return _mask(logits, request), cache
  logits, cache = model.draft_logits(features, tokens, last_index, cache, lengths, depth,
                                     vocab=vocab)
  return (draft_vocab_lib.mask_ids(logits, vocab.ids, request.vocab_limit, request.banned_ids),
          cache)


def _vocab(model, request: DecodeRequest, ids: Array):
  """The draft vocabulary of ids [M] as the heads take it (`MTPModel.draft_vocab`: its rows of
  the output layer, gathered once, outside the loop's steps); None when the request has none."""
  return model.draft_vocab(ids) if request.draft_vocab_size else None


def _ids(vocab) -> Array | None:
  return None if vocab is None else vocab.ids


@functools.partial(jax.jit, static_argnames=('structure', 'request'))
def _start(structure, leaves, prompts: Array, lengths: Array, rng: Array, eos_id: Array,
           pad_id: Array, active: Array, request: DecodeRequest,
           costs: Array | float = 0.0, probe_steps: Array | int = 8,
           lookup_min_key: Array | int = 0, draft_vocab: Array | None = None) -> LoopState:
  """Prefills [B, P] right-padded prompts: each row's first token and first drafts.

  active: [B] rows to prefill; the others (fillers) are marked done (row-mapped requests skip
  their work).
  costs, probe_steps, lookup_min_key: `LoopState`'s (requests that fall back).
  draft_vocab: [M] int32 ids (`request.draft_vocab_size` = M > 0), else None.
  """
  if draft_vocab is None:
    draft_vocab = jnp.zeros((0,), jnp.int32)
  model = _model(state_lib.merge(structure, leaves), request, active)
  tree = request.tree
  b, p = prompts.shape
  cache = state_lib.shard_cache(model.init_cache(b, request.capacity), request.mesh)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  # Padding slots get written too, but they lie at or past each row's length: scratch.
  out, cache = model.step(prompts, positions, cache, jnp.zeros((b,), jnp.int32),
                          with_heads=tree.head_depth > 0)
  last_index = lengths - 1
  rng, key = jax.random.split(rng)
  last_normed = kv_cache_lib.gather_rows(out.normed, last_index)
  first = _sample(key, _logits(model, last_normed, request), request)
  known = kv_cache_lib.write_rows(jnp.pad(prompts, ((0, 0), (0, 1))),
                                  first[:, None].astype(prompts.dtype), lengths)
  vocab = _vocab(model, request, draft_vocab)
  head_logits, cache = _head_logits(model, request, out.features, known, last_index, cache,
                                    jnp.zeros((b,), jnp.int32), vocab)
  buffer = jnp.full((b, request.max_new_tokens + request.depth + 1), pad_id, jnp.int32)
  context = jnp.zeros((b, 0), jnp.int32)
  if tree.lookup_depth:  # Spare columns: writes of a block near the end never clamp.
    context = jnp.zeros((b, request.capacity + request.depth + 2), jnp.int32)
    context = context.at[:, :p].set(prompts.astype(jnp.int32))
    context = kv_cache_lib.write_rows(context, first[:, None], lengths)
  buffer, num_generated, done, _ = state_lib.append_tokens(
      buffer, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
      jnp.ones((b,), jnp.int32), eos_id=eos_id, pad_id=pad_id,
      max_new_tokens=request.max_new_tokens)
  drafts, lookup_key, block_nodes = _drafts(request, head_logits, context, lengths, vocab)
  return LoopState(tokens=buffer, num_generated=num_generated, done=done | ~active,
                   last_token=first, drafts=drafts, block_nodes=block_nodes, lengths=lengths,
                   num_steps=jnp.zeros((b,), jnp.int32),
                   histogram=jnp.zeros((b, request.depth + 2), jnp.int32), cache=cache,
                   rng=rng, eos_id=eos_id, pad_id=pad_id, context=context,
                   lookup_key=lookup_key,
                   pays=jnp.full((2,), request.drafts),
                   idle=jnp.zeros((2,), jnp.int32),
                   costs=jnp.broadcast_to(jnp.asarray(costs, jnp.float32), (2,)),
                   block_tokens=jnp.zeros((b, 2), jnp.int32),
                   block_steps=jnp.zeros((b, 2), jnp.int32),
                   probe_steps=jnp.broadcast_to(jnp.asarray(probe_steps, jnp.int32), (2,)),
                   lookup_min_key=jnp.asarray(lookup_min_key, jnp.int32),
                   draft_vocab=draft_vocab)


def _verify(model, s: LoopState, drafts: Array, request: DecodeRequest, key: Array,
            tree: trees_lib.Tree | dynamic_trees.RowTrees):
  """One verification pass over `tree` (the request's, its heads' part, or every row's own
  dynamic tree) and acceptance.

  Returns:
    nodes: [B, N] the block's tokens; out: the step's StepOutput over the block; cache: with
    the block written; path: [B, depth + 1] accepted node indices root first, padded with the last
    accepted node; num_accepted: [B] accepted drafts; next_token: [B] the trunk's own token.
  """
  nodes = jnp.concatenate([s.last_token[:, None], drafts], axis=1)  # [B, N]
  chain = isinstance(tree, trees_lib.Tree) and tree.is_chain
  depth = tree.depth if isinstance(tree, dynamic_trees.RowTrees) else tree.depth[None, :]
  positions = s.lengths[:, None] + jnp.asarray(depth)
  mask = None if chain else jnp.asarray(tree.attention_mask)
  out, cache = model.step(nodes, positions, s.cache, s.lengths, block_mask=mask,
                          with_heads=request.tree.head_depth > 0)
  if not request.drafts:  # Nothing to accept: the trunk's own token, as one-token decoding.
    next_token = _sample(key, _logits(model, out.normed[:, 0], request), request)
    zeros = jnp.zeros_like(s.lengths)
    return nodes, out, cache, zeros[:, None], zeros, next_token
  logits = _logits(model, out.normed, request)  # [B, N, V]: any node may be continued from.
  if not request.greedy:
    probs = sampling_lib.target_probs(logits, request.temperature, request.top_k,
                                      request.top_p)
  if chain:
    if request.greedy:
      num_accepted, next_token = sampling_lib.greedy_accept_chain(drafts, logits)
    else:
      num_accepted, next_token = sampling_lib.rejection_accept_chain(key, drafts, None, probs)
    path = jnp.broadcast_to(jnp.arange(nodes.shape[1], dtype=jnp.int32), nodes.shape)
  else:
    if request.greedy:
      path, num_accepted, next_token = sampling_lib.greedy_accept_tree(tree, nodes, logits)
    else:
      path, num_accepted, next_token = sampling_lib.rejection_accept_tree(key, tree, nodes,
                                                                          probs)
    last_node = kv_cache_lib.gather_rows(path, num_accepted)
    path = jnp.where(path >= 0, path, last_node[:, None])
  return nodes, out, cache, path, num_accepted, next_token


@functools.partial(jax.jit, static_argnames=('structure', 'request'), donate_argnames=('state',))
def _run(structure, leaves, state: LoopState, max_steps: Array, hook_data,
         request: DecodeRequest) -> LoopState:
  """Runs draft-verify-accept steps until every row is done or `max_steps` steps were taken."""
  base = state_lib.merge(structure, leaves)
  tree = request.tree
  heads_tree = tree.without_lookup()
  num_verified_layers = base.num_verified_cache_layers
  # Gathered once per call, outside the steps (XLA does not hoist it out of a cond branch).
  vocab = _vocab(base, request, state.draft_vocab)

  def cond(carry):
    i, s = carry
    return (i < max_steps) & ~jnp.all(s.done)

  def draft_step(s: LoopState, block: trees_lib.Tree = tree, kind: int = 1) -> LoopState:
    """Verifies `block` (the request's tree, or its heads' part: its first nodes; a dynamic
    tree: each row's chosen nodes of it) and drafts the request's whole tree for the next
    step. `kind` is the `LoopState.pays` entry."""
    # Greedy decoding draws nothing: skip the split (a small loop of its own on CPU).
    rng, key = (s.rng, s.rng) if request.greedy else tuple(jax.random.split(s.rng))
    model = _model(base, request, ~s.done)
    drafts = s.drafts
    if request.draft_hook is not None:
      drafts = request.draft_hook(drafts, s.num_generated, hook_data).astype(jnp.int32)
    verified = block
    if request.tree_budget:
      verified = dynamic_trees.row_trees(block, s.block_nodes)
    else:
      drafts = drafts[:, :block.num_nodes - 1]
    nodes, out, cache, path, num_accepted, next_token = _verify(model, s, drafts, request, key,
                                                                verified)
    path_tokens = jnp.take_along_axis(nodes, path, axis=1)  # [B, depth + 1], root first.
    # Emitted in order: the accepted drafts, then the trunk's own token.
    shifted = jnp.concatenate([path_tokens[:, 1:], next_token[:, None]], axis=1)
    columns = jnp.arange(block.max_depth + 1)[None, :]
    emitted = jnp.where(columns < num_accepted[:, None], shifted, next_token[:, None])
    buffer, num_generated, done, kept = state_lib.append_tokens(
        s.tokens, s.num_generated, s.done, emitted, num_accepted + 1, eos_id=s.eos_id,
        pad_id=s.pad_id, max_new_tokens=request.max_new_tokens)

    if request.tree_budget or not block.is_chain:
      # A chain's accepted prefix already sits at lengths .. lengths + n.
      cache = _compact(cache, s.lengths, path, num_verified_layers)
    # The accepted path is contiguous in the cache now (slots lengths ..): draft from it.
    features = jax.tree.map(lambda f: jnp.take_along_axis(
        f, path.reshape(path.shape + (1,) * (f.ndim - 2)), axis=1), out.features)
    known = kv_cache_lib.write_rows(jnp.pad(path_tokens, ((0, 0), (0, 1))),
                                    next_token[:, None], num_accepted + 1)
    head_logits, cache = _head_logits(model, request, features, known, num_accepted, cache,
                                      s.lengths, vocab)
    lengths = s.lengths + num_accepted + 1
    context = s.context
    if tree.lookup_depth:  # Emitted tokens sit at positions s.lengths + 1 .. lengths.
      context = kv_cache_lib.write_rows(context, emitted, s.lengths + 1)
    new_drafts, lookup_key, block_nodes = _drafts(request, head_logits, context, lengths,
                                                  vocab)

    active = ~s.done
    return _advance(s, active, buffer, num_generated, done, kept, next_token, lengths,
                    cache, rng, kind=kind, drafts=new_drafts, context=context,
                    lookup_key=lookup_key, block_nodes=block_nodes)

  def one_token_step(s: LoopState) -> LoopState:
    """Autoregressive decoding inside a drafting loop, where drafting stopped paying: the
    heads neither run nor draft (their cache layers and drafts go stale: a later drafting step
    is exact all the same, its stale drafts only fail). Lookup drafts stay current."""
    rng, key = (s.rng, s.rng) if request.greedy else tuple(jax.random.split(s.rng))
    model = _model(base, request, ~s.done)
    out, cache = model.step(s.last_token[:, None], s.lengths[:, None], s.cache, s.lengths,
                            with_heads=False)
    next_token = _sample(key, _logits(model, out.normed[:, 0], request), request)
    buffer, num_generated, done, kept = state_lib.append_tokens(
        s.tokens, s.num_generated, s.done, next_token[:, None], jnp.ones_like(s.lengths),
        eos_id=s.eos_id, pad_id=s.pad_id, max_new_tokens=request.max_new_tokens)
    active = ~s.done
    lengths = s.lengths + 1
    drafts, context, lookup_key = s.drafts, s.context, s.lookup_key
    if tree.lookup_depth:
      context = kv_cache_lib.write_rows(context, next_token[:, None], lengths)
      copies, lookup_key = lookup_lib.propose_with_key(context, lengths, tree.lookup_depth)
      drafts = drafts.at[:, -tree.lookup_depth:].set(copies)
    return _advance(s, active, buffer, num_generated, done, kept, next_token, lengths, cache,
                    rng, kind=None, drafts=drafts, context=context, lookup_key=lookup_key,
                    block_nodes=s.block_nodes)

  def judge(s: LoopState) -> LoopState:
    """Whether each kind of drafting step keeps up with its break-even, in tokens per step so
    far of the row furthest behind (true until it took `probe_steps` steps of that kind), and
    the retry of kinds that stopped (`LoopState`).

    The row furthest behind, because a batch runs until its last row is done: rows ahead
    that accept many drafts (a repeating text) finish early and wait, while every step costs
    the whole batch the block's price; measured on the demo model at batch 8, judging by the
    mean of all rows ran the whole block for the repeating rows and came out at 0.66x."""
    behind = jnp.argmin(jnp.where(s.done, jnp.iinfo(jnp.int32).max, s.num_generated))
    tokens, steps = s.block_tokens[behind], s.block_steps[behind]
    early = steps < s.probe_steps
    pays = s.pays & (early | (tokens.astype(jnp.float32)
                              >= s.costs * steps.astype(jnp.float32)))
    idle = jnp.where(pays, 0, s.idle + 1)
    failed_retry = jnp.maximum(s.costs - 1, 0)  # One step whose drafts all fail.
    retry = ~pays & (idle.astype(jnp.float32) * (request_lib.FALLBACK_BUDGET / 2)
                     >= failed_retry)
    return s.replace(pays=pays | retry, idle=jnp.where(retry, 0, idle),
                     probe_steps=jnp.where(retry, 1, s.probe_steps),
                     block_tokens=jnp.where(retry, 0, s.block_tokens),
                     block_steps=jnp.where(retry, 0, s.block_steps))  # Every row's.

  def body(carry):
    i, s = carry
    if not request.fallback:
      s = draft_step(s)
    elif not tree.lookup_depth:
      s = jax.lax.cond(s.pays[0], functools.partial(draft_step, kind=0), one_token_step, s)
    else:
      # The whole block only where every row's lookup drafts look likely to pass (the whole
      # batch pays for it), else the heads'.
      promising = jnp.all(s.done | (s.lookup_key >= s.lookup_min_key))
      branch = jnp.where(s.pays[1] & promising, 2, jnp.where(s.pays[0], 1, 0))
      s = jax.lax.switch(branch, (
          one_token_step, functools.partial(draft_step, block=heads_tree, kind=0),
          draft_step), s)
    if request.fallback:
      s = judge(s)
    return i + 1, s

  _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state


def _advance(s: LoopState, active: Array, buffer: Array, num_generated: Array, done: Array,
             kept: Array, next_token: Array, lengths: Array, cache, rng: Array, *,
             kind: int | None, drafts: Array, context: Array, lookup_key: Array,
             block_nodes: Array) -> LoopState:
  """The state after one step of kind `kind` (None: a one-token step): active rows move on,
  finished ones keep their state."""
  histogram = s.histogram + (
      jax.nn.one_hot(kept, s.histogram.shape[1], dtype=jnp.int32) * active[:, None])
  block_tokens, block_steps = s.block_tokens, s.block_steps
  if kind is not None:
    block_tokens = block_tokens.at[:, kind].add(kept * active)
    block_steps = block_steps.at[:, kind].add(active.astype(jnp.int32))
  return s.replace(
      tokens=buffer, num_generated=num_generated, done=done,
      last_token=jnp.where(active, next_token, s.last_token),
      drafts=jnp.where(active[:, None], drafts, s.drafts),
      block_nodes=jnp.where(active[:, None], block_nodes, s.block_nodes),
      lengths=jnp.where(active, lengths, s.lengths),
      num_steps=s.num_steps + active, histogram=histogram, cache=cache, rng=rng,
      context=jnp.where(active[:, None], context, s.context),
      lookup_key=jnp.where(active, lookup_key, s.lookup_key),
      block_tokens=block_tokens, block_steps=block_steps)


def _model(model, request: DecodeRequest, active: Array):
  """The model as the loop calls it: row by row for a row-mapped request (`row_mapped.py`),
  the inactive rows skipped."""
  return row_mapped.RowMapped(model, active) if request.row_mapped else model


def result(state: LoopState, max_new_tokens: int) -> DecodeResult:
  """The loop state as a `DecodeResult`."""
  return DecodeResult(tokens=state.tokens[:, :max_new_tokens],
                      num_generated=state.num_generated, num_steps=state.num_steps,
                      accepted_histogram=state.histogram)



# ------------------------------------------------------------------------------------------
# Entry points.
# ------------------------------------------------------------------------------------------


def decode(model, prompts: Array, prompt_lengths: Array, request: DecodeRequest, *, rng=None,
           eos_id: int | None = None, pad_id: int = 0, hook_data=None,
           break_even: float | tuple[float, float] = 0.0,
           probe_steps: int | tuple[int, int] = 8, draft_vocab=None) -> DecodeResult:
  """Decodes checked prompts (`request.check_prompts`) with a checked request.

  Args:
    model: an `MTPModel`, or a `state.PreparedModel` of one (faster when reused).
    prompts: [B, P] int32 token ids, right-padded; prompt_lengths: [B] int32.
    request: from `request.make_request`.
    rng: int seed or PRNG key (sampling only).
    eos_id: a row stops after generating this token (kept in the output); None: never.
    pad_id: filler after a row's end in `tokens`.
    hook_data: pytree of arrays passed to `request.draft_hook` (traced: no recompilation).
    break_even: 'auto' requests (`request.fallback`): drafting's break-even in tokens per step
      (`auto.break_even` measures it; traced: no recompilation); 0: never stop drafting. A
      pair gives the heads' block's and the whole block's apart (a tree with a lookup chain
      has both kinds of drafting step, `LoopState`).
    probe_steps: 'auto' requests: steps drafted before the first check (`auto.probe_steps`);
      a pair: (heads' block, whole block).
    draft_vocab: [M] distinct token ids the heads draft over, M = `request.draft_vocab_size`
      (`draft_vocab.top_ids`; traced: no recompilation); None when the request has none.
  """
  prepared, state = _begin(model, prompts, prompt_lengths, request, rng, eos_id, pad_id,
                           break_even=break_even, probe_steps=probe_steps,
                           draft_vocab=draft_vocab)
  state = _run(prepared.structure, prepared.leaves, state, jnp.int32(request.max_new_tokens),
               hook_data, request)
  return result(state, request.max_new_tokens)


def decode_chunks(model, prompts: Array, prompt_lengths: Array, request: DecodeRequest, *,
                  steps_per_chunk: int, rng=None, eos_id: int | None = None, pad_id: int = 0,
                  hook_data=None, active=None,
                  stop: Callable[[], np.ndarray | None] | None = None,
                  break_even: float | tuple[float, float] = 0.0,
                  probe_steps: int | tuple[int, int] = 8,
                  draft_vocab=None) -> Iterator[DecodeResult]:
  """Like `decode`, but yields the partial result (numpy) after the prefill and each chunk.

  The chunk size is not part of the compiled code; streaming costs one host round trip per
  chunk of `steps_per_chunk` loop steps, not per token.

  active: [B] bool rows to decode (None: all); the others are fillers, done from the start.
  stop: called before each chunk; the [B] bool rows it returns (or None) stop there, as if
    finished (a server's cancelled requests). Row-mapped requests then skip their work.
  """
  prepared, state = _begin(model, prompts, prompt_lengths, request, rng, eos_id, pad_id,
                           active, break_even, probe_steps, draft_vocab)
  # Host copies: the next `_run` donates (invalidates) the state's device buffers.
  yield jax.device_get(result(state, request.max_new_tokens))
  while True:
    stopped = stop() if stop is not None else None
    if stopped is not None and np.any(stopped):
      state = state.replace(done=state.done | jnp.asarray(stopped, bool))
    if bool(jnp.all(state.done)):
      break
    state = _run(prepared.structure, prepared.leaves, state, jnp.int32(steps_per_chunk),
                 hook_data, request)
    yield jax.device_get(result(state, request.max_new_tokens))


def _begin(model, prompts, prompt_lengths, request: DecodeRequest, rng, eos_id, pad_id,
           active=None, break_even=0.0, probe_steps=8, draft_vocab=None):
  prepared = state_lib.prepare(model)
  break_even, probe_steps = request_lib.check_fallback(break_even, probe_steps)
  draft_vocab = _checked_draft_vocab(prepared, request, draft_vocab)
  if active is None:
    active = np.ones(np.shape(prompts)[0], bool)
  prompts, prompt_lengths, active = state_lib.shard_rows(
      (jnp.asarray(prompts), jnp.asarray(prompt_lengths), jnp.asarray(active, bool)),
      request.mesh)
  state = _start(prepared.structure, prepared.leaves, prompts, prompt_lengths,
                 state_lib.as_key(rng), jnp.int32(-1 if eos_id is None else eos_id),
                 jnp.int32(pad_id), active, request,
                 jnp.asarray(break_even, jnp.float32), jnp.asarray(probe_steps, jnp.int32),
                 jnp.int32(request_lib.LOOKUP_MIN_KEY),
                 draft_vocab=draft_vocab)
  return prepared, state


def _checked_draft_vocab(model, request: DecodeRequest, ids) -> Array | None:
  """The draft vocabulary's ids on device, checked against the request; None without one."""
  if not request.draft_vocab_size:
    if ids is not None:
      raise ValueError('draft_vocab is given, but the request has draft_vocab_size 0')
    return None
  if ids is None:
    raise ValueError(f'the request drafts over a draft vocabulary of '
                     f'{request.draft_vocab_size} ids: pass them (draft_vocab=)')
  return jnp.asarray(draft_vocab_lib.check_ids(ids, request.draft_vocab_size,
                                               model.cfg.trunk.vocab_size))


def seconds_per_step(model, prompts: Array, prompt_lengths: Array, request: DecodeRequest, *,
                     drafting: bool, heads_only: bool = False, steps: int = 16,
                     repeats: int = 3, warm_up: bool = True, draft_vocab=None) -> float:
  """Wall seconds per loop step of `request`'s compiled decoder on these prompts.

  drafting: time drafting steps (break-even 0: drafting never stops) or, with a request that
    can fall back (`request.fallback`), one-token steps: the same compiled loop, so that the
    two are compared on equal terms and measuring compiles nothing that decoding will not use.
  heads_only: a request that falls back and has a lookup chain: time drafting steps of the
    heads' block alone; else drafting steps verify the whole block, lookup chain included.
  The fastest of `repeats` runs counts, after one untimed run that compiles (`warm_up`); rows
  never stop at EOS. draft_vocab: as in `decode`; None with a request that has one: its size's
  first ids (which ids does not change the cost of a step).
  """
  if request.draft_vocab_size and draft_vocab is None:
    draft_vocab = np.arange(request.draft_vocab_size, dtype=np.int32)
  if heads_only and not (request.fallback and request.tree.lookup_depth):
    raise ValueError('heads_only times the heads\' block of a request that falls back and has '
                     'a lookup chain')
  if not drafting and not request.fallback:
    raise ValueError('one-token steps of a request without fallback: time an autoregressive '
                     'request instead')
  prepared = state_lib.prepare(model)
  best = float('inf')
  for attempt in range(repeats + 1 if warm_up else repeats):
    _, state = _begin(prepared, prompts, prompt_lengths, request, 0, None, 0,
                      draft_vocab=draft_vocab)
    forced = jnp.asarray([drafting, drafting and not heads_only])
    # Kinds forced off are never retried (a retry waits for idle to reach a positive count).
    state = state.replace(pays=forced, idle=jnp.where(forced, 0, -2**30),
                          lookup_min_key=jnp.int32(0))
    jax.block_until_ready(state)
    start = time.perf_counter()
    state = jax.block_until_ready(_run(prepared.structure, prepared.leaves, state,
                                       jnp.int32(steps), None, request))
    seconds = time.perf_counter() - start
    taken = int(jnp.max(state.num_steps))
    if (attempt or not warm_up) and taken:
      best = min(best, seconds / taken)
  return best


class Slots:
  """A fixed batch of rows that requests join and leave between chunks (continuous batching).

  `join` prefills new prompts into chosen rows (one compiled prefill for the batch shape, the
  other rows skipped when the request is row-mapped) and splices them into the running state;
  `stop` ends rows; `run` advances every live row by a chunk of loop steps. With a row-mapped
  request each row's tokens are those of a batch of one, whenever it joined.
  """

  def __init__(self, model, request: DecodeRequest, batch_size: int, *, rng=None,
               eos_id: int | None = None, pad_id: int = 0, hook_data=None, draft_vocab=None):
    self.prepared = state_lib.prepare(model)
    self._draft_vocab = _checked_draft_vocab(self.prepared, request, draft_vocab)
    self.request, self.batch_size, self.hook_data = request, int(batch_size), hook_data
    self._eos = jnp.int32(-1 if eos_id is None else eos_id)
    self._pad = jnp.int32(pad_id)
    self._rng = state_lib.as_key(rng)
    self._joins = 0
    self.state: LoopState | None = None

  def join(self, prompts, prompt_lengths, rows) -> None:
    """Prefills prompts [B, P] (checked, P the request's width) into the rows [B] marked."""
    rows = np.asarray(rows, bool)
    self._joins += 1
    fresh = _start(self.prepared.structure, self.prepared.leaves, jnp.asarray(prompts),
                   jnp.asarray(prompt_lengths), jax.random.fold_in(self._rng, self._joins),
                   self._eos, self._pad, jnp.asarray(rows), self.request,
                   draft_vocab=self._draft_vocab)
    self.state = fresh if self.state is None else _splice(self.state, fresh, jnp.asarray(rows))

  def stop(self, rows) -> None:
    """Marks rows [B] done: they stop changing (and cost nothing when row-mapped)."""
    rows = np.asarray(rows, bool)
    if self.state is not None and rows.any():
      self.state = self.state.replace(done=self.state.done | jnp.asarray(rows))

  def run(self, steps: int) -> None:
    """Up to `steps` loop steps for the live rows."""
    if self.state is not None and not bool(jnp.all(self.state.done)):
      self.state = _run(self.prepared.structure, self.prepared.leaves, self.state,
                        jnp.int32(steps), self.hook_data, self.request)

  def result(self) -> DecodeResult:
    """Every row's result so far, on the host."""
    return jax.device_get(result(self.state, self.request.max_new_tokens))


@jax.jit
def _splice(state: LoopState, fresh: LoopState, rows: Array) -> LoopState:
  """`fresh`'s rows where `rows`, `state`'s elsewhere; the running PRNG key and ids stay."""
  def pick(old, new):
    if old.ndim == 0:
      return old
    return jnp.where(rows.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
  # Fields that are not per row (the draft vocabulary, the fallback's accounting) stay.
  shared = {name: None for name in _BATCH_FIELDS}
  spliced = jax.tree.map(pick, state.replace(**shared), fresh.replace(**shared))
  return spliced.replace(**{name: getattr(state, name) for name in _BATCH_FIELDS})


_BATCH_FIELDS = ('draft_vocab', 'pays', 'idle', 'costs', 'probe_steps')


def generate(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
             decoder: str = 'speculative', eos_id: int | None = None, pad_id: int = 0,
             rng=None, hook_data=None, break_even: float | tuple[float, float] = 0.0,
             probe_steps: int | tuple[int, int] = 8, draft_vocab=None,
             **options) -> DecodeResult:
  """Checks the request, then decodes: the one entry point of every decoder.

  Greedy (temperature 0) output of every decoder equals greedy autoregressive output token
  for token (up to float ties); sampled output has the same distribution (rejection sampling;
  temperature, top-k and top-p shape the target before verification).

  Args:
    model: an `MTPModel`, or a `state.PreparedModel` of one (faster when reused).
    prompts: [B, P] int token ids, right-padded (see `state.pad_prompts`).
    prompt_lengths: [B] valid tokens per row (None: all P).
    max_new_tokens: tokens to generate per row at most.
    decoder: a name in `decoders.NAMES`.
    eos_id, pad_id, rng, hook_data, break_even, probe_steps: as in `decode`.
    draft_vocab: [M] token ids the heads draft over (FR-Spec, `draft_vocab.top_ids`); the
      request's `draft_vocab_size` is then M. None: the whole vocabulary.
    **options: the rest of `request.make_request`'s options: tree, lookup, temperature, top_k,
      top_p, cache_capacity, draft_hook, mesh.

  Returns:
    DecodeResult; accepted_histogram is [B, tree depth + 2].

  Raises:
    ValueError naming the bad input, before anything is compiled.
  """
  prompts, prompt_lengths, request = _checked(model, prompts, prompt_lengths, max_new_tokens,
                                              decoder, eos_id, hook_data, options, draft_vocab)
  return decode(model, prompts, prompt_lengths, request, rng=rng, eos_id=eos_id, pad_id=pad_id,
                hook_data=hook_data, break_even=break_even, probe_steps=probe_steps,
                draft_vocab=draft_vocab)


def generate_chunks(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
                    decoder: str = 'speculative', steps_per_chunk: int | None = None,
                    eos_id: int | None = None, pad_id: int = 0, rng=None, hook_data=None,
                    break_even: float | tuple[float, float] = 0.0,
                    probe_steps: int | tuple[int, int] = 8, draft_vocab=None,
                    **options) -> Iterator[DecodeResult]:
  """`generate`, yielding the partial result after the prefill and each chunk of steps.

  steps_per_chunk: loop steps per host round trip (None: the decoder's default).
  """
  steps_per_chunk = request_lib.steps_per_chunk(steps_per_chunk, decoder)
  prompts, prompt_lengths, request = _checked(model, prompts, prompt_lengths, max_new_tokens,
                                              decoder, eos_id, hook_data, options, draft_vocab)
  return decode_chunks(model, prompts, prompt_lengths, request,
                       steps_per_chunk=steps_per_chunk, rng=rng, eos_id=eos_id,
                       pad_id=pad_id, hook_data=hook_data, break_even=break_even,
                       probe_steps=probe_steps, draft_vocab=draft_vocab)


def _checked(model, prompts, prompt_lengths, max_new_tokens, decoder, eos_id, hook_data,
             options, draft_vocab=None):
  if options.get('draft_hook') is None and hook_data is not None:
    raise ValueError('hook_data is given without a draft_hook')
  trunk = model.cfg.trunk
  prompts, prompt_lengths = request_lib.check_prompts(
      prompts, prompt_lengths, max_new_tokens=max_new_tokens, vocab_size=trunk.vocab_size,
      max_seq_len=trunk.max_seq_len, eos_id=eos_id)
  if draft_vocab is not None:
    options = dict(options, draft_vocab_size=int(np.shape(draft_vocab)[0])
                   if np.ndim(draft_vocab) == 1 else -1)  # -1: make_request names the problem.
  request = request_lib.make_request(model.cfg, prompts.shape[1], max_new_tokens=max_new_tokens,
                                     decoder=decoder, **options)
  _checked_draft_vocab(model, request, draft_vocab)
  return prompts, prompt_lengths, request
