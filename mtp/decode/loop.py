"""The decode loop: draft, verify, accept, on device, in one `lax.while_loop`.

Each step, for every row of the batch at once:
  1. verify: one cached `model.step` over the block [newest token, drafts...], the drafts of
     the plan's first k drafters (`plan.block(k)`; k, the step's kind, is every drafter unless
     the `auto` policy chooses fewer; kind 0 decodes one token) laid out as a tree: node n sits
     at position length + depth(n) and attends to its ancestors only;
  2. accept: the longest drafted path the trunk agrees with, plus one token of the trunk's own
     (the correction, or the bonus when every draft on the path passes): greedy argmax match or
     exact speculative rejection sampling, per row (`sampling.accept`);
  3. cut the accepted tokens exactly where one-token decoding would stop (a stop id, the row's
     own token budget);
  4. keep the KV entries of the accepted path: a chain's accepted prefix is already contiguous;
     a tree's path is moved to the front of the block (`kv_cache.compact`);
  5. draft the next block: the MTP heads run at the newest accepted node, if a drafter reads
     them, and every drafter renews its state (`drafters.Drafter.update`).
Rows finish on their own and stop changing; nothing goes back to the host per step.

The prefill runs the prompts through the trunk in chunks: the longest prompt's whole
`LONG_PREFILL_CHUNK`s, then `PREFILL_CHUNK`s to its end. With the cache's chunked attention
(`kv_cache.attend`), a row's prefill and steps compute the same numbers whatever its prompt's
padding and its cache's capacity, so a row decodes to the same tokens in a batch sized for it
and in a server's batch sized for its longest request.

Everything here is a pure function of the model, the plan (static), the plan's data (arrays)
and the state. `engine.py` is the one door that compiles and calls it.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import draft_vocab as draft_vocab_lib
from mtp.decode import drafters as drafters_lib
from mtp.decode import dynamic_trees
from mtp.decode import finish
from mtp.decode import sampling as sampling_lib
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib
from mtp.decode import trees as trees_lib
from mtp.decode import verification
from mtp.model import kv_cache as kv_cache_lib
from mtp.model.heads import tree_drafts

Array = jax.Array
PREFILL_CHUNK = 64
LONG_PREFILL_CHUNK = 256  # SmolLM2, bf16, 2 CPU cores: 526-token prompts' prefill -18%.
RUNNING, STOP_ID, LENGTH, CANCELLED = (finish.RUNNING, finish.STOP_ID, finish.LENGTH,
                                       finish.CANCELLED)


@flax.struct.dataclass
class Logprobs:
  """The model's log-probabilities of each emitted token and its top alternatives ([B, 0...]
  when the plan keeps none): chosen [B, W], top_ids [B, W, K], top_values [B, W, K]."""
  chosen: Array
  top_ids: Array
  top_values: Array


@flax.struct.dataclass
class LoopState:
  """The decode loop's carry (W = plan.max_new_tokens + block depth + 1 output columns).

  Attributes:
    tokens: [B, W] emitted tokens (spare columns: writes never clamp; stale after a row's end).
    logprobs: the emitted tokens' log-probabilities (`Logprobs`).
    num_generated: [B] tokens emitted.
    reason: [B] why a row stopped (`STOP_ID`, `LENGTH`, `CANCELLED`), `RUNNING` while it runs.
    last_token: [B] the newest token (the next block's root), not yet in the cache.
    lengths: [B] committed cache slots (= the position of last_token).
    num_steps: [B] loop steps that worked on the row.
    histogram: [B, depth + 2] steps per number of tokens emitted.
    cache: the KV cache.
    settings: the rows' own settings (`settings.RowSettings`).
    drafters: one state per drafter of the plan.
    policy: the `auto` policy's per-row accounts (`auto.State`), or () without a policy.
  """
  tokens: Array
  logprobs: Logprobs
  num_generated: Array
  reason: Array
  last_token: Array
  lengths: Array
  num_steps: Array
  histogram: Array
  cache: kv_cache_lib.KVCache
  settings: settings_lib.RowSettings
  drafters: tuple
  policy: object


# ---- Shared pieces. ---------------------------------------------------------------------


def _mask(plan, logits: Array) -> Array:
  """Logits [..., V] with the ids the plan never emits at -inf."""
  return sampling_lib.mask_vocab(logits, plan.vocab_limit, plan.banned_ids)


def _logits(model, plan, normed: Array) -> Array:
  """The trunk's logits [..., V] over the ids the plan may emit."""
  return _mask(plan, model.logits(normed))


def _head_vocab(model, plan, data):
  """The heads' draft vocabulary, gathered once per call outside the steps (XLA does not hoist
  it out of a loop's branch); None without one."""
  return model.draft_vocab(data.drafters[plan.heads_drafter]) if plan.draft_vocab_size else None


def _head_drafts(model, plan, vocab, features, tokens: Array, last_index: Array, cache,
                 lengths: Array):
  """The heads' drafts of every node of the heads drafter's tree (`heads.TreeDrafts` [B, M])
  below each row's last accepted token, over emittable ids only, and the cache (heads that
  attend write their layers)."""
  drafter = plan.drafters[plan.heads_drafter]
  tokens = jnp.pad(tokens, ((0, 0), (0, drafter.head_depth)))  # Scratch for their drafts.
  mask = functools.partial(_mask, plan) if vocab is None else functools.partial(
      draft_vocab_lib.mask_ids, ids=vocab.ids, vocab_limit=plan.vocab_limit,
      banned_ids=plan.banned_ids)
  return model.draft_tree(features, tokens, last_index, cache, lengths, drafter.head_nodes,
                          vocab=vocab, mask=mask, budget=drafter.head_budget)


def _logprobs(plan, logits: Array, tokens: Array) -> Logprobs:
  """`Logprobs` of tokens [B, T] under logits [B, T, V] (empty when the plan keeps none)."""
  if plan.logprobs < 0:
    return _empty_logprobs(tokens.shape[0])
  chosen, ids, values = sampling_lib.token_logprobs(logits, tokens, plan.logprobs)
  return Logprobs(chosen=chosen, top_ids=ids, top_values=values)


def _empty_logprobs(b: int, width: int = 0, top: int = 0) -> Logprobs:
  return Logprobs(chosen=jnp.zeros((b, width)), top_ids=jnp.zeros((b, width, top), jnp.int32),
                  top_values=jnp.zeros((b, width, top)))


def _append(s: LoopState, emitted: Array, num_emitted: Array, logprobs: Logprobs):
  """Appends each running row's new tokens, cut exactly where one-token decoding would stop:
  after a stop id (kept) or at the row's budget. Returns (tokens, logprobs, num_generated,
  reason, kept [B])."""
  index = jnp.arange(emitted.shape[1])[None, :]
  running = s.reason == RUNNING
  budget = s.settings.max_tokens
  take = jnp.where(running, jnp.minimum(num_emitted, budget - s.num_generated), 0)
  stops = s.settings.stop_ids
  is_stop = jnp.any((emitted[:, :, None] == stops[:, None, :]) & (stops[:, None, :] >= 0),
                    axis=-1) & (index < take[:, None])
  hit = jnp.any(is_stop, axis=1)
  take = jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, take)
  write = functools.partial(kv_cache_lib.write_rows, offsets=s.num_generated)
  tokens = write(s.tokens, jnp.where(index < take[:, None], emitted, 0).astype(s.tokens.dtype))
  logprobs = (jax.tree.map(lambda old, new: write(old, new), s.logprobs, logprobs)
              if s.logprobs.chosen.shape[1] else s.logprobs)
  num_generated = s.num_generated + take
  reason = jnp.where(~running, s.reason, jnp.where(
      hit, STOP_ID, jnp.where(num_generated >= budget, LENGTH, RUNNING)))
  return tokens, logprobs, num_generated, reason.astype(jnp.int32), take.astype(jnp.int32)


def _rows(mask: Array, new, old):
  """`new` in rows where mask [B], `old` elsewhere, leaf by leaf ([B, ...] leaves)."""
  def pick(n, o):
    return jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
  return jax.tree.map(pick, new, old)


# ---- The prefill. -----------------------------------------------------------------------


def prefill(model, data, plan, prompts: Array, lengths: Array, active: Array,
            settings: settings_lib.RowSettings) -> LoopState:
  """Prefills [B, P] right-padded prompts (P a multiple of `PREFILL_CHUNK`): each active row's
  first token and first drafts. Inactive rows (fillers, rows joining nothing) are cancelled.

  Long chunks make a long prompt's products wider and its steps fewer (526 tokens: 2 + 1, not
  9); a short one pads no more. Half-precision products on CPU are row-invariant, so where the
  chunks fall changes no bits; float32's may change the last ones, as a batch's size does."""
  b, p = prompts.shape
  c, long_c = PREFILL_CHUNK, LONG_PREFILL_CHUNK
  depth = plan.head_depth
  vocab = _head_vocab(model, plan, data)
  cache = state_lib.shard_cache(model.init_cache(b, plan.capacity), plan.mesh)
  last = lengths - 1
  keys = settings_lib.step_keys(settings, jnp.zeros((b,), jnp.int32))
  padded = jnp.pad(prompts, ((0, 0), (0, long_c + 1 + depth)))
  carry = (cache, jnp.zeros((b,), jnp.int32),
           tree_drafts.empty(plan.drafters[plan.heads_drafter].head_nodes, b) if depth else None,
           _empty_logprobs(b, 1 if plan.logprobs >= 0 else 0, max(plan.logprobs, 0)))

  def chunk(start, c, carry):  # Tokens [start, start + c) (the heads draft where rows end).
    cache, first, head_drafts, first_logprobs = carry
    tokens = jax.lax.dynamic_slice_in_dim(padded, start, c, axis=1)
    runs = active & (start < lengths)
    m = plan.wrap(model, runs)
    starts = jnp.full((b,), start, jnp.int32)
    out, cache = m.step(tokens, starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :],
                        cache, starts, with_heads=depth > 0)
    ends = runs & (last < start + c)
    index = jnp.clip(last - start, 0, c - 1)
    logits = _logits(m, plan, kv_cache_lib.gather_rows(out.normed, index))
    token = sampling_lib.sample_tokens(keys, logits, settings.temperature, settings.top_k,
                                       settings.top_p, active=ends,
                                       greedy_only=plan.greedy_only)
    first = jnp.where(ends, token, first)
    first_logprobs = _rows(ends, _logprobs(plan, logits[:, None], token[:, None]),
                           first_logprobs)
    if depth:
      known = jax.lax.dynamic_slice_in_dim(padded, start, c + 1, axis=1)
      known = jnp.where(ends[:, None], kv_cache_lib.write_rows(known, token[:, None], index + 1),
                        known)
      drafted, cache = _head_drafts(m, plan, vocab, out.features, known, index, cache, starts)
      head_drafts = _rows(ends, drafted, head_drafts)
    return cache, first, head_drafts, first_logprobs

  longest = jnp.max(jnp.where(active, lengths, 0))
  done = jnp.zeros((), jnp.int32)
  if not isinstance(p, int) or p >= long_c:  # A symbolic width (an export) may be long.
    done = longest // long_c * long_c
    carry = jax.lax.fori_loop(0, done // long_c, lambda i, x: chunk(i * long_c, long_c, x), carry)
  cache, first, head_drafts, first_logprobs = jax.lax.fori_loop(
      0, (longest - done + c - 1) // c, lambda i, x: chunk(done + i * c, c, x), carry)

  width = plan.max_new_tokens + plan.depth + 1
  empty = LoopState(
      tokens=jnp.zeros((b, width), jnp.int32),
      logprobs=_empty_logprobs(b, width if plan.logprobs >= 0 else 0, max(plan.logprobs, 0)),
      num_generated=jnp.zeros((b,), jnp.int32),
      reason=jnp.where(active, RUNNING, CANCELLED).astype(jnp.int32), last_token=first,
      lengths=lengths.astype(jnp.int32), num_steps=jnp.zeros((b,), jnp.int32),
      histogram=jnp.zeros((b, plan.depth + 2), jnp.int32), cache=cache, settings=settings,
      drafters=(), policy=())
  tokens, logprobs, num_generated, reason, _ = _append(empty, first[:, None],
                                                       jnp.ones((b,), jnp.int32), first_logprobs)
  prefilled = drafters_lib.Prefilled(prompts=prompts, lengths=lengths, first_token=first,
                                     head_drafts=head_drafts)
  states = tuple(d.start(prefilled, data.drafters[i]) for i, d in enumerate(plan.drafters))
  return empty.replace(tokens=tokens, logprobs=logprobs, num_generated=num_generated,
                       reason=reason, drafters=states, policy=() if plan.policy is None else
                       plan.policy.start_rows(data, settings))


# ---- The steps. -------------------------------------------------------------------------


def _drafting_step(model, data, plan, vocab, s: LoopState, row_kind: Array | None,
                   kind: int) -> LoopState:
  """Verifies the block of the plan's first `kind` drafters; `row_kind` [B]: the kind whose
  drafts each row may accept (None: every one)."""
  active = s.reason == RUNNING
  keys = settings_lib.step_keys(s.settings, s.num_steps + 1)
  m = plan.wrap(model, active)
  block, owner = plan.block(kind)
  verified = plan.drafters[:kind]
  drafts = jnp.concatenate([d.drafts(state).astype(jnp.int32)
                            for d, state in zip(verified, s.drafters)], axis=1)
  if plan.draft_hook is not None:
    drafts = plan.draft_hook(drafts, s.num_generated, data.hook).astype(jnp.int32)
  tree = verified[0].row_trees(s.drafters[0]) if verified[0].dynamic else block
  nodes = jnp.concatenate([s.last_token[:, None], drafts], axis=1)  # [B, N]
  chain = isinstance(tree, trees_lib.Tree) and tree.is_chain
  depth = tree.depth if isinstance(tree, dynamic_trees.RowTrees) else tree.depth[None, :]
  out, cache, slot = verification.step(m, tree, nodes, s.lengths[:, None] + jnp.asarray(depth),
                                       s.cache, s.lengths, with_heads=plan.head_depth > 0)
  logits = _logits(m, plan, out.normed)  # [B, N, V]: any node may be continued from.
  enabled = None
  if row_kind is not None:
    enabled = jnp.asarray(owner)[None, :] < row_kind[:, None]
  path, num_accepted, next_token = sampling_lib.accept(
      keys, tree, nodes, logits, s.settings, active=active, enabled=enabled,
      greedy_only=plan.greedy_only)
  path_tokens = jnp.take_along_axis(nodes, path, axis=1)  # [B, depth + 1], root first.
  # Emitted in order: the accepted drafts, then the trunk's own token.
  shifted = jnp.concatenate([path_tokens[:, 1:], next_token[:, None]], axis=1)
  columns = jnp.arange(path.shape[1])[None, :]
  emitted = jnp.where(columns < num_accepted[:, None], shifted, next_token[:, None])
  logprobs = _logprobs(plan, jnp.take_along_axis(logits, path[..., None], axis=1), emitted)
  if not chain:  # A chain's accepted prefix already sits at lengths .. lengths + n.
    cache = kv_cache_lib.compact_layers(cache, s.lengths, path if slot is None else slot[path],
                                        m.num_verified_cache_layers)
  head_drafts = None
  if plan.head_depth:  # The accepted path is contiguous in the cache now: draft from it.
    features = jax.tree.map(lambda f: jnp.take_along_axis(
        f, path.reshape(path.shape + (1,) * (f.ndim - 2)), axis=1), out.features)
    known = kv_cache_lib.write_rows(jnp.pad(path_tokens, ((0, 0), (0, 1))),
                                    next_token[:, None], num_accepted + 1)
    head_drafts, cache = _head_drafts(m, plan, vocab, features, known, num_accepted, cache,
                                      s.lengths)
  return _advance(plan, data, s, emitted, num_accepted + 1, next_token, logprobs, cache,
                  head_drafts)


def _one_token_step(model, data, plan, vocab, s: LoopState,
                    row_kind: Array | None = None) -> LoopState:
  """Decodes one token per row; the heads neither run nor draft (their drafts go stale: a later
  drafting step is exact all the same, its stale drafts only fail)."""
  del vocab, row_kind
  active = s.reason == RUNNING
  keys = settings_lib.step_keys(s.settings, s.num_steps + 1)
  m = plan.wrap(model, active)
  out, cache = m.step(s.last_token[:, None], s.lengths[:, None], s.cache, s.lengths,
                      with_heads=False)
  logits = _logits(m, plan, out.normed[:, 0])
  next_token = sampling_lib.sample_tokens(keys, logits, s.settings.temperature,
                                          s.settings.top_k, s.settings.top_p, active=active,
                                          greedy_only=plan.greedy_only)
  emitted = next_token[:, None]
  logprobs = _logprobs(plan, logits[:, None], emitted)
  return _advance(plan, data, s, emitted, jnp.ones_like(s.lengths), next_token, logprobs,
                  cache, None)


def _advance(plan, data, s: LoopState, emitted: Array, num_emitted: Array,
             next_token: Array, logprobs: Logprobs, cache, head_drafts) -> LoopState:
  """The state after a step: running rows move on, finished ones keep their state."""
  active = s.reason == RUNNING
  tokens, logprobs, num_generated, reason, kept = _append(s, emitted, num_emitted, logprobs)
  accepted = drafters_lib.Accepted(emitted=emitted, num_emitted=num_emitted, lengths=s.lengths,
                                   head_drafts=head_drafts)
  states = tuple(d.update(state, accepted, data.drafters[i])
                 for i, (d, state) in enumerate(zip(plan.drafters, s.drafters)))
  histogram = s.histogram + (jax.nn.one_hot(kept, s.histogram.shape[1], dtype=jnp.int32)
                             * active[:, None])
  return s.replace(
      tokens=tokens, logprobs=logprobs, num_generated=num_generated, reason=reason,
      last_token=jnp.where(active, next_token, s.last_token),
      lengths=jnp.where(active, s.lengths + num_emitted, s.lengths),
      num_steps=s.num_steps + active, histogram=histogram, cache=cache,
      drafters=_rows(active, states, s.drafters))


def run(model, data, plan, state: LoopState, max_steps: Array,
        least_running: Array | int = 1) -> LoopState:
  """Runs loop steps until fewer than `least_running` rows run (1: every row is done) or
  `max_steps` steps were taken."""
  step_args = (model, data, plan, _head_vocab(model, plan, data))
  kinds = plan.num_kinds

  def cond(carry):
    return (carry[0] < max_steps) & (jnp.sum(carry[1].reason == RUNNING) >= least_running)

  def body(carry):
    i, s = carry
    if plan.policy is None:
      if kinds:
        return i + 1, _drafting_step(*step_args, s, None, kinds)
      return i + 1, _one_token_step(*step_args, s)
    active = s.reason == RUNNING
    rows = (s.policy, drafters_lib.ready_rows(plan.drafters, s.drafters), active,
            s.settings.temperature == 0, s.settings.max_tokens - s.num_generated, data.force)
    costs = plan.policy.row_costs(data.costs, rows[3])  # [B, K]: greedy or sampled rows'.
    kind, row_kind = plan.policy.choose(*rows, costs)
    quiet = jnp.minimum(plan.policy.quiet_steps(*rows, costs), max_steps - i)
    branches = [functools.partial(_one_token_step, *step_args)] + [
        functools.partial(_drafting_step, *step_args, kind=k) for k in range(1, kinds + 1)]
    new, passes = _run_kind(kind, quiet, branches, s, row_kind)
    policy = plan.policy.observe(s.policy, costs, jnp.where(kind > 0, row_kind, 0),
                                 new.num_generated - s.num_generated, new.num_steps - s.num_steps,
                                 drafters_lib.evidence_rows(plan.drafters, new.drafters))
    return i + passes, new.replace(policy=policy)

  _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state


def _run_kind(kind: Array, quiet: Array, branches, s: LoopState, row_kind: Array):
  """`branches[kind](s, row_kind)` (kind 0: up to `quiet` one-token steps, while every row
  that runs keeps running) and the passes it made, as one while loop per kind: a `lax.switch`
  copied the whole KV cache into and out of its branches each step (XLA:CPU, +40% per
  one-token step), a while loop's body updates its carry in place."""
  running, passes = jnp.sum(s.reason == RUNNING), jnp.zeros((), jnp.int32)
  for k, branch in enumerate(branches):
    limit = jnp.where(kind == k, quiet if k == 0 else 1, 0)
    def more(carry, limit=limit):
      return (carry[0] < limit) & (jnp.sum(carry[1].reason == RUNNING) == running)
    def once(carry, branch=branch):
      return carry[0] + 1, branch(carry[1], row_kind)
    done, s = jax.lax.while_loop(more, once, (jnp.zeros((), jnp.int32), s))
    passes += done
  return s, passes


# ---- Rows joining and leaving. ----------------------------------------------------------


def splice(state: LoopState, fresh: LoopState, rows: Array) -> LoopState:
  """`fresh`'s rows where `rows` [B], `state`'s elsewhere (every field is per row)."""
  return _rows(rows, fresh, state)


def stop(state: LoopState, rows: Array) -> LoopState:
  """Rows [B] still running are cancelled: they stop changing (and cost nothing when rows are
  mapped one by one)."""
  return state.replace(reason=jnp.where(rows & (state.reason == RUNNING), CANCELLED,
                                        state.reason))
