"""Exact self-speculative decoding: the model's heads draft, its trunk verifies, on device.

Each loop iteration, for every row of the batch at once:
  1. verify: one cached `model.step` over the block [last token, draft_1..draft_N] laid out as
     a candidate tree (a chain is the tree of top-1 drafts): node n sits at position
     length + depth(n) and attends to its ancestors only (`tree.attention_mask`);
  2. accept: the longest drafted path the trunk agrees with, plus one token of the trunk's own
     (the correction, or the bonus when every draft on the path passes): greedy argmax match or
     exact speculative rejection sampling (`sampling.py`);
  3. cut the accepted tokens exactly where one-token decoding would stop (EOS, max_new_tokens);
  4. keep the KV entries of the accepted path: a chain's accepted prefix is already contiguous;
     a tree's path is moved to the front of the block (`kv_cache.compact`); the rest of the
     block becomes scratch again;
  5. draft the next block from the same pass: medusa and parallel heads are read at the last
     accepted node only (head logits for one position per row, not for the block); sequential
     (DeepSeek-V3) modules run in turn over the accepted path, module k + 1 reading the draft
     of module k. A tree with a lookup chain (`trees.with_lookup`, greedy) also copies the
     tokens that followed the row's last few tokens earlier in its own text (`lookup.py`).

All of it, prefill aside, is one jitted `lax.while_loop` over a `LoopState`; rows finish on
their own and stop changing; nothing goes back to the host per step.

Sequential modules and their caches: module k at position t needs embed(x_{t+k}). Each
iteration runs every module over the accepted path, with the emitted tokens where they are
known and the fresh drafts where they are not yet (the last k - 1 positions of module k). Those
few cache entries therefore hold draft-conditioned keys that are never recomputed once the true
tokens are known. This only affects draft quality; verification by the trunk keeps the output
exact. Tree drafts of sequential heads condition every module on the top-1 draft of the one
before, and take the top-k of each module's distribution for the tree's ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import lookup as lookup_lib
from mtp.decode import sampling as sampling_lib
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.model import kv_cache as kv_cache_lib

Array = jax.Array
DecodeResult = state_lib.DecodeResult
# (drafts [B, N], num_generated [B], hook_data) -> drafts [B, N]; for tests and experiments
# (oracle or adversarial drafts). The function is part of the compiled decoder's identity;
# hook_data (any pytree of arrays) is traced, so new data does not recompile.
DraftHook = Callable[[Array, Array, object], Array]


@dataclasses.dataclass(frozen=True)
class Settings:
  """Static settings of one compiled decoder (hashable: a jit static argument)."""
  max_new_tokens: int
  capacity: int
  tree: trees_lib.Tree
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  draft_hook: DraftHook | None = None
  mesh: jax.sharding.Mesh | None = None  # Shard the batch and the KV cache over it.

  @property
  def depth(self) -> int:
    return self.tree.max_depth

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


@flax.struct.dataclass
class LoopState:
  """The speculative loop's carry (D = tree depth, N = tree nodes - 1 drafts).

  Attributes:
    tokens: [B, max_new_tokens + D + 1] output buffer (spare columns: writes never clamp).
    num_generated: [B] tokens in the buffer.
    done: [B] rows that stopped; they no longer change.
    last_token: [B] the newest token (the next block's root), not yet in the cache.
    drafts: [B, N] the next block's drafted nodes, in tree node order (root excluded).
    lengths: [B] committed cache slots (= position of last_token).
    num_steps: [B] verification passes that worked on the row.
    histogram: [B, D + 2] steps per number of tokens emitted.
    cache: the KV cache.
    rng: PRNG key.
    eos_id: [] int32 end-of-sequence id, -1 for none (traced: changing it does not recompile).
    pad_id: [] int32 filler after a row's end.
    context: [B, C] every row's tokens by position, prompt included, for lookup drafts
      (position lengths holds last_token; later columns are stale); [B, 0] without lookup.
  """
  tokens: Array
  num_generated: Array
  done: Array
  last_token: Array
  drafts: Array
  lengths: Array
  num_steps: Array
  histogram: Array
  cache: kv_cache_lib.KVCache
  rng: Array
  eos_id: Array
  pad_id: Array
  context: Array


# ------------------------------------------------------------------------------------------
# Drafting.
# ------------------------------------------------------------------------------------------


def _drafts(tree: trees_lib.Tree, logits: Array, context: Array, lengths: Array) -> Array:
  """Head logits [D, B, V] (and the lookup chain's copies) -> drafted nodes [B, N - 1].

  N - 1 drafts in tree order, root excluded; `context` and `lengths` (the position of the newest
  token) feed the lookup chain, if the tree has one.
  """
  if tree.is_chain:
    return jnp.argmax(logits, axis=-1).T.astype(jnp.int32)
  top = jax.lax.top_k(logits, max(tree.topk_per_depth))[1]  # [D, B, R]
  copies = None
  if tree.lookup_depth:
    copies = lookup_lib.propose(context, lengths, tree.lookup_depth)
  nodes = trees_lib.draft_tokens_for_tree(tree, jnp.transpose(top, (1, 0, 2)),
                                          lookup_tokens=copies)
  return nodes[:, 1:].astype(jnp.int32)


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


def _sample(rng: Array, logits: Array, s: Settings) -> Array:
  return sampling_lib.sample_tokens(rng, logits, s.temperature, s.top_k, s.top_p)


@functools.partial(jax.jit, static_argnames=('structure', 'settings'))
def _start(structure, leaves, prompts: Array, lengths: Array, rng: Array, eos_id: Array,
           pad_id: Array, settings: Settings) -> LoopState:
  """Prefills [B, P] right-padded prompts: each row's first token and first drafts."""
  model = state_lib.merge(structure, leaves)
  tree, depth = settings.tree, settings.tree.head_depth
  b, p = prompts.shape
  cache = state_lib.shard_cache(model.init_cache(b, settings.capacity), settings.mesh)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  out, cache = model.step(prompts, positions, cache, jnp.zeros((b,), jnp.int32))
  last_index = lengths - 1
  rng, key = jax.random.split(rng)
  first = _sample(key, model.logits(state_lib.gather_rows(out.normed, last_index)), settings)
  ext = jnp.concatenate([prompts, jnp.zeros((b, depth), prompts.dtype)], axis=1)
  ext = kv_cache_lib.write_rows(ext, first[:, None].astype(ext.dtype), lengths)
  head_logits, cache = model.draft_logits(out.features, ext, last_index, cache,
                                          jnp.zeros((b,), jnp.int32), depth)
  buffer = jnp.full((b, settings.max_new_tokens + settings.depth + 1), pad_id, jnp.int32)
  context = jnp.zeros((b, 0), jnp.int32)
  if tree.lookup_depth:  # Spare columns: writes of a block near the end never clamp.
    context = jnp.zeros((b, settings.capacity + settings.depth + 2), jnp.int32)
    context = context.at[:, :p].set(prompts.astype(jnp.int32))
    context = kv_cache_lib.write_rows(context, first[:, None], lengths)
  buffer, num_generated, done, _ = state_lib.append_tokens(
      buffer, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
      jnp.ones((b,), jnp.int32), eos_id=eos_id, pad_id=pad_id,
      max_new_tokens=settings.max_new_tokens)
  return LoopState(tokens=buffer, num_generated=num_generated, done=done, last_token=first,
                   drafts=_drafts(tree, head_logits, context, lengths), lengths=lengths,
                   num_steps=jnp.zeros((b,), jnp.int32),
                   histogram=jnp.zeros((b, settings.depth + 2), jnp.int32), cache=cache,
                   rng=rng, eos_id=eos_id, pad_id=pad_id, context=context)


def _verify(model, s: LoopState, drafts: Array, settings: Settings, key: Array):
  """One verification pass and acceptance.

  Returns:
    out: the step's StepOutput over the block; cache: with the block written;
    path: [B, D + 1] accepted node indices root first, padded with the last accepted node;
    num_accepted: [B] accepted drafts; next_token: [B] the trunk's own token.
  """
  tree = settings.tree
  nodes = jnp.concatenate([s.last_token[:, None], drafts], axis=1)  # [B, T]
  positions = s.lengths[:, None] + jnp.asarray(tree.depth)[None, :]
  mask = None if tree.is_chain else jnp.asarray(tree.attention_mask)
  out, cache = model.step(nodes, positions, s.cache, s.lengths, block_mask=mask)
  logits = model.logits(out.normed)  # [B, T, V]: every node may be the one we continue from.
  if not settings.greedy:
    probs = sampling_lib.target_probs(logits, settings.temperature, settings.top_k,
                                      settings.top_p)
  if tree.is_chain:
    if settings.greedy:
      num_accepted, next_token = sampling_lib.greedy_accept_chain(drafts, logits)
    else:
      num_accepted, next_token = sampling_lib.rejection_accept_chain(key, drafts, None, probs)
    path = jnp.broadcast_to(jnp.arange(nodes.shape[1], dtype=jnp.int32), nodes.shape)
  else:
    if settings.greedy:
      path, num_accepted, next_token = sampling_lib.greedy_accept_tree(tree, nodes, logits)
    else:
      path, num_accepted, next_token = sampling_lib.rejection_accept_tree(key, tree, nodes,
                                                                          probs)
    last_node = state_lib.gather_rows(path, num_accepted)
    path = jnp.where(path >= 0, path, last_node[:, None])
  return nodes, out, cache, path, num_accepted, next_token


@functools.partial(jax.jit, static_argnames=('structure', 'settings'), donate_argnames=('state',))
def _run(structure, leaves, state: LoopState, max_steps: Array, hook_data,
         settings: Settings) -> LoopState:
  """Runs draft-verify-accept steps until every row is done or `max_steps` steps were taken."""
  model = state_lib.merge(structure, leaves)
  tree, depth, head_depth = settings.tree, settings.depth, settings.tree.head_depth
  num_verified_layers = model.num_verified_cache_layers
  columns = jnp.arange(depth + 1)[None, :]

  def cond(carry):
    i, s = carry
    return (i < max_steps) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    # Greedy decoding draws nothing: skip the split (a small loop of its own on CPU).
    rng, key = (s.rng, s.rng) if settings.greedy else tuple(jax.random.split(s.rng))
    drafts = s.drafts
    if settings.draft_hook is not None:
      drafts = settings.draft_hook(drafts, s.num_generated, hook_data).astype(jnp.int32)
    nodes, out, cache, path, num_accepted, next_token = _verify(model, s, drafts, settings, key)
    path_tokens = jnp.take_along_axis(nodes, path, axis=1)  # [B, D + 1], root first.
    # Emitted in order: the accepted drafts, then the trunk's own token.
    shifted = jnp.concatenate([path_tokens[:, 1:], next_token[:, None]], axis=1)
    emitted = jnp.where(columns < num_accepted[:, None], shifted, next_token[:, None])
    buffer, num_generated, done, kept = state_lib.append_tokens(
        s.tokens, s.num_generated, s.done, emitted, num_accepted + 1, eos_id=s.eos_id,
        pad_id=s.pad_id, max_new_tokens=settings.max_new_tokens)

    if not tree.is_chain:  # A chain's accepted prefix already sits at lengths .. lengths + n.
      cache = _compact(cache, s.lengths, path, num_verified_layers)
    # The accepted path is contiguous in the cache now (slots lengths ..): draft from it.
    features = jax.tree.map(lambda f: jnp.take_along_axis(
        f, path.reshape(path.shape + (1,) * (f.ndim - 2)), axis=1), out.features)
    ext = jnp.concatenate([path_tokens, jnp.zeros((path.shape[0], head_depth), jnp.int32)], 1)
    ext = kv_cache_lib.write_rows(ext, next_token[:, None], num_accepted + 1)
    head_logits, cache = model.draft_logits(features, ext, num_accepted, cache, s.lengths,
                                            head_depth)
    lengths = s.lengths + num_accepted + 1
    context = s.context
    if tree.lookup_depth:  # Emitted tokens sit at positions s.lengths + 1 .. lengths.
      context = kv_cache_lib.write_rows(context, emitted, s.lengths + 1)
    new_drafts = _drafts(tree, head_logits, context, lengths)

    active = ~s.done
    histogram = s.histogram + (
        jax.nn.one_hot(kept, depth + 2, dtype=jnp.int32) * active[:, None])
    s = s.replace(
        tokens=buffer, num_generated=num_generated, done=done,
        last_token=jnp.where(active, next_token, s.last_token),
        drafts=jnp.where(active[:, None], new_drafts, s.drafts),
        lengths=jnp.where(active, lengths, s.lengths),
        num_steps=s.num_steps + active, histogram=histogram, cache=cache, rng=rng,
        context=jnp.where(active[:, None], context, s.context))
    return i + 1, s

  _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state


def result(state: LoopState, max_new_tokens: int) -> DecodeResult:
  """The loop state as a `DecodeResult`."""
  return DecodeResult(tokens=state.tokens[:, :max_new_tokens],
                      num_generated=state.num_generated, num_steps=state.num_steps,
                      accepted_histogram=state.histogram)


# ------------------------------------------------------------------------------------------
# Public API.
# ------------------------------------------------------------------------------------------


def resolve_tree(model, tree, lookup: int = 0) -> trees_lib.Tree:
  """The candidate tree for `model` from a user's choice, checked against its heads.

  Args:
    model: an `MTPModel` or a `state.PreparedModel`.
    tree: None (a chain of every head's top-1), an int k (a chain of k drafts), a
      `trees.Tree`, or Medusa-style choices (a sequence of rank paths).
    lookup: if > 0, hang a chain of this many prompt-lookup drafts below the root too
      (`trees.with_lookup`; greedy decoding only).

  Raises:
    ValueError: the model has no heads, or the tree is empty or deeper than the heads.
  """
  num_heads = model.cfg.mtp_num_heads
  if num_heads == 0:
    raise ValueError('speculative decoding needs a model with MTP heads: this model has '
                     'mtp_num_heads=0 (use the autoregressive decoder)')
  if tree is None:
    tree = trees_lib.chain_tree(num_heads)
  elif isinstance(tree, (int, np.integer)) and not isinstance(tree, bool):
    if tree < 1:
      raise ValueError(f'chain length must be >= 1, got {tree}')
    if tree > num_heads:
      raise ValueError(f'chain length {tree} exceeds the number of MTP heads {num_heads}')
    tree = trees_lib.chain_tree(int(tree))
  elif not isinstance(tree, trees_lib.Tree):
    tree = trees_lib.tree_from_choices(tree)
  if tree.head_depth < 1:
    raise ValueError('the candidate tree has no drafted nodes')
  tree.check_num_heads(num_heads)
  if lookup:
    tree = trees_lib.with_lookup(tree, lookup)
  return tree


def _prepare(model, prompts, prompt_lengths, *, max_new_tokens, tree, eos_id, pad_id,
             temperature, top_k, top_p, rng, cache_capacity, draft_hook, hook_data, mesh=None,
             lookup=0):
  tree = resolve_tree(model, tree, lookup)
  if tree.lookup_depth and temperature != 0:
    raise ValueError('lookup drafts are verified greedily only (temperature 0), got '
                     f'temperature {temperature}')
  cfg = model.cfg.trunk
  prompts, lengths = state_lib.check_request(
      prompts, prompt_lengths, max_new_tokens=max_new_tokens, vocab_size=cfg.vocab_size,
      max_seq_len=cfg.max_seq_len, temperature=temperature, top_k=top_k, top_p=top_p,
      eos_id=eos_id)
  if not tree.is_chain and max(tree.topk_per_depth) > cfg.vocab_size:
    raise ValueError(f'the tree needs the top-{max(tree.topk_per_depth)} drafts of a head, '
                     f'more than the vocabulary size {cfg.vocab_size}')
  capacity = state_lib.cache_capacity(prompts.shape[1], max_new_tokens, tree.num_nodes,
                                      cache_capacity)
  if draft_hook is None and hook_data is not None:
    raise ValueError('hook_data is given without a draft_hook')
  settings = Settings(max_new_tokens=int(max_new_tokens), capacity=capacity, tree=tree,
                      temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                      draft_hook=draft_hook, mesh=mesh)
  args = (*state_lib.shard_rows((jnp.asarray(prompts), jnp.asarray(lengths)), mesh),
          state_lib.as_key(rng),
          jnp.int32(-1 if eos_id is None else eos_id), jnp.int32(pad_id))
  return state_lib.prepare(model), args, settings


def generate(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
             tree: trees_lib.Tree | int | Sequence[Sequence[int]] | None = None,
             eos_id: int | None = None, pad_id: int = 0, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, rng=None, cache_capacity: int | None = None,
             draft_hook: DraftHook | None = None, hook_data=None,
             mesh: jax.sharding.Mesh | None = None, lookup: int = 0) -> DecodeResult:
  """Self-speculative decoding; the output is distributed exactly as `autoregressive.generate`.

  Greedy (temperature 0) output equals greedy autoregressive output token for token (up to
  float ties); sampled output has the same distribution (rejection sampling; temperature,
  top-k and top-p shape the target before verification; drafts are the heads' top-k).

  Args:
    model: an `MTPModel` with heads, or a `state.PreparedModel` of one (faster when reused).
    prompts: [B, P] int token ids, right-padded (see `state.pad_prompts`).
    prompt_lengths: [B] valid tokens per row (None: all P).
    max_new_tokens: tokens to generate per row at most.
    tree: candidate tree: None = chain of all heads, int k = chain of k heads, a `trees.Tree`,
      or Medusa-style choices.
    eos_id, pad_id, temperature, top_k, top_p, rng: as in `autoregressive.generate`.
    cache_capacity: KV slots (default: prompt width + max_new_tokens + tree size).
    draft_hook: replaces the drafts before each verification (tests: oracle or adversarial
      drafts); (drafts [B, N], num_generated [B], hook_data) -> [B, N].
    hook_data: pytree of arrays passed to draft_hook (traced: no recompilation).
    mesh: shard the rows (prompts, cache, loop state) over its batch axes and the cache's KV
      heads over 'tensor'; pass parameters already sharded (`mesh.state_shardings`).
    lookup: drafts of a prompt-lookup chain added to the tree (`trees.with_lookup`; greedy
      only): copies of what followed the latest earlier occurrence of the text's last tokens.

  Returns:
    DecodeResult; accepted_histogram is [B, tree depth + 2].
  """
  prepared, args, settings = _prepare(
      model, prompts, prompt_lengths, max_new_tokens=max_new_tokens, tree=tree, eos_id=eos_id,
      pad_id=pad_id, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng,
      cache_capacity=cache_capacity, draft_hook=draft_hook, hook_data=hook_data, mesh=mesh,
      lookup=lookup)
  state = _start(prepared.structure, prepared.leaves, *args, settings)
  state = _run(prepared.structure, prepared.leaves, state, jnp.int32(max_new_tokens), hook_data,
               settings)
  return result(state, settings.max_new_tokens)


def generate_chunks(model, prompts, prompt_lengths=None, *, max_new_tokens: int,
                    steps_per_chunk: int = 4, **kwargs) -> Iterator[DecodeResult]:
  """Like `generate`, but yields the partial result (numpy) after the prefill and each chunk.

  The chunk size is not part of the compiled code; streaming costs one host round trip per
  chunk of `steps_per_chunk` verification steps, not per token.
  """
  if steps_per_chunk < 1:
    raise ValueError(f'steps_per_chunk must be >= 1, got {steps_per_chunk}')
  allowed = dict(tree=None, eos_id=None, pad_id=0, temperature=0.0, top_k=0, top_p=1.0,
                 rng=None, cache_capacity=None, draft_hook=None, hook_data=None, mesh=None,
                 lookup=0)
  unknown = set(kwargs) - set(allowed)
  if unknown:
    raise TypeError(f'unexpected arguments: {", ".join(sorted(unknown))}')
  options = {**allowed, **kwargs}
  prepared, args, settings = _prepare(
      model, prompts, prompt_lengths, max_new_tokens=max_new_tokens, **options)
  state = _start(prepared.structure, prepared.leaves, *args, settings)
  # Host copies: the next `_run` donates (invalidates) the state's device buffers.
  yield jax.device_get(result(state, settings.max_new_tokens))
  while not bool(jnp.all(state.done)):
    state = _run(prepared.structure, prepared.leaves, state, jnp.int32(steps_per_chunk),
                 options['hook_data'], settings)
    yield jax.device_get(result(state, settings.max_new_tokens))
