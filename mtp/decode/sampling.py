"""Sampling and exact acceptance rules for self-speculative decoding.

Everything here is a pure, jittable jnp function batched over rows B. Sampling settings are
per-row data, not compile-time constants: temperature [B] (0 = greedy), top_k [B] (0 = off) and
top_p [B] (1 = off), so rows with any mix of settings share one compiled decoder (a Python
number stands for every row). Randomness is per row too: functions that draw take one PRNG key
per row ([B] keys), so what a row draws never depends on the other rows.

Acceptance rules verify drafted tokens against the trunk's predictions from one forward pass:
  * greedy: accept the longest run of drafts equal to the trunk's argmax; the output equals plain
    greedy decoding token for token.
  * sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), and its
    multi-candidate form on trees (SpecInfer, Miao et al. 2023); every emitted token is
    distributed exactly as sampling from the target distribution p one token at a time.
A greedy row is a sampled row whose target is one-hot at the argmax, so either rule gives it
the same tokens; `accept` gives greedy rows the greedy rule (the deepest agreeing path) and
walks the sampled rows through their block, shaping the target only at the nodes they reach.

Conventions: the target at candidate position i (chain) or node n (tree) is the trunk's
distribution of the token that follows it. Position 0 / node 0 is the last accepted token.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import dynamic_trees
from mtp.decode import trees as trees_lib
from mtp.model import argmax as argmax_lib
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import products

_NEG_INF = -jnp.inf
# Top-k and top-p look for their thresholds among this many top logits first (a partial top_k
# is cheap), and fall back to an exact bisection over the whole vocabulary when some row needs
# more. A full sort would be simpler but costs 4.4 s on CPU for [192, 49152] logits (top_k(256):
# 0.06 s, bisection: 0.8 s).
_TOP_CANDIDATES = 256
# Ids per block of the running sums that draw a token (`_sample_from_probs`).
_DRAW_BLOCK = 256


def validate_sampling(temperature, top_k, top_p, vocab_size: int | None = None) -> None:
  """Raises ValueError naming the bad value: temperature not a finite number >= 0, top_p not
  in (0, 1], top_k not an integer in [0, vocab_size]."""
  if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
      or not 0 <= temperature < math.inf):  # Also catches NaN.
    raise ValueError(f'temperature must be >= 0 (0 = greedy) and a finite number, got '
                     f'{temperature!r}')
  if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
    raise ValueError(f'top_p must be in (0, 1] (1 = off), got {top_p!r}')
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
    raise ValueError(f'top_k must be an integer (0 = off), got {top_k!r}')
  if top_k < 0:
    raise ValueError(f'top_k must be >= 0 (0 = off), got {top_k}')
  if vocab_size is not None and top_k > vocab_size:
    raise ValueError(f'top_k must be <= the vocabulary size {vocab_size}, got {top_k}')


def mask_vocab(logits: jnp.ndarray, vocab_limit: int | None,
               banned_ids: tuple[int, ...]) -> jnp.ndarray:
  """logits [..., V] with ids >= vocab_limit and `banned_ids` at -inf (static settings).

  Applied to the trunk's logits before sampling or acceptance, and to the heads' before
  drafting, so every decoder emits only ids the tokenizer can decode.
  """
  if vocab_limit is None and not banned_ids:
    return logits
  allowed = np.arange(logits.shape[-1]) < (vocab_limit or logits.shape[-1])
  allowed[list(banned_ids)] = False
  return jnp.where(jnp.asarray(allowed), logits, _NEG_INF)


def _per_row(value, like: jnp.ndarray, dtype) -> jnp.ndarray:
  """A setting against logits `like` [B, ..., V]: a number stays a scalar (every row, whatever
  the logits' shape), [B] becomes [B, 1, ..., 1]."""
  value = jnp.asarray(value, dtype)
  if not value.ndim:
    return value
  return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


def _row_sum(x: jnp.ndarray) -> jnp.ndarray:
  """[..., V] -> [..., 1]: the sum over the last axis in a fixed order. XLA:CPU vectorises a
  reduction by the whole array's shape, so a plain sum gives a row other bits beside other rows
  or in a verification block than alone: a row's probabilities, and so the tokens its seed
  draws, would then depend on its neighbours (`products.ordered_sum`)."""
  return products.ordered_sum(x, axis=-1, keepdims=True)


def _softmax(logits: jnp.ndarray) -> jnp.ndarray:
  """jax.nn.softmax over the last axis, normalised by `_row_sum`."""
  unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  return unnormalised / _row_sum(unnormalised)


def shape_logits(logits: jnp.ndarray, temperature=1.0, top_k=0, top_p=1.0) -> jnp.ndarray:
  """Applies temperature, then top-k, then top-p, per row, masking removed tokens to -inf.

  Args:
    logits: [B, ..., V].
    temperature: [B] or a number; 0 = greedy: every token but the argmax is masked.
    top_k: [B] or a number; 0 = off. Tokens tied with the k-th largest logit are kept too.
    top_p: [B] or a number; 1 = off; keeps the smallest prefix of the sorted (post top-k)
      distribution whose mass reaches top_p, plus ties with its last logit. The top token
      always stays.

  Returns:
    [B, ..., V] float32 logits of the shaped distribution.
  """
  logits = logits.astype(jnp.float32)
  temperature = _per_row(temperature, logits, jnp.float32)
  top_k = _per_row(top_k, logits, jnp.int32)
  top_p = _per_row(top_p, logits, jnp.float32)
  greedy = temperature == 0
  # In a form that stays finite for any temperature > 0: the top logit becomes exactly 0 and the
  # others x / T <= 0, which may underflow to -inf but never gives inf - inf = NaN (a plain
  # softmax(logits / 1e-10) does on float32).
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
  scaled = jnp.where(shifted == 0, 0.0, shifted / jnp.where(greedy, 1.0, temperature))
  v = logits.shape[-1]
  use_k = (top_k > 0) & (top_k < v)
  use_p = top_p < 1

  def truncated():  # Only where some row keeps fewer than all tokens: the top_k costs.
    top = jax.lax.top_k(scaled, min(_TOP_CANDIDATES, v))[0]  # [..., C], descending.
    kth = jnp.take_along_axis(top, jnp.broadcast_to(
        jnp.clip(top_k - 1, 0, top.shape[-1] - 1), top.shape[:-1] + (1,)), axis=-1)
    if top.shape[-1] < v:  # A row whose k exceeds the candidates: count over the whole row.
      exact = lambda: jnp.where(top_k > top.shape[-1], _from_order_keys(_largest_threshold(  # noqa
          _order_keys(scaled), jnp.ones_like(scaled), top_k.astype(jnp.float32))), kth)
      kth = jax.lax.cond(jnp.any(use_k & (top_k > top.shape[-1])), exact, lambda: kth)
    kept = jnp.where(use_k & (scaled < kth), _NEG_INF, scaled)
    top = jnp.where(use_k & (top < kth), _NEG_INF, top)
    threshold = jax.lax.cond(jnp.any(use_p), lambda: _top_p_threshold(kept, top, top_p),
                             lambda: jnp.full_like(kth, _NEG_INF))
    return jnp.where(use_p & (kept < threshold), _NEG_INF, kept)

  scaled = jax.lax.cond(jnp.any(use_k | use_p), truncated, lambda: scaled)

  def with_greedy_rows():
    best = jnp.arange(v) == argmax_lib.argmax(logits)[..., None]
    return jnp.where(greedy, jnp.where(best, logits, _NEG_INF), scaled)

  return jax.lax.cond(jnp.any(greedy), with_greedy_rows, lambda: scaled)


def _top_p_threshold(logits: jnp.ndarray, top: jnp.ndarray, top_p: jnp.ndarray) -> jnp.ndarray:
  """Smallest logit of each row's nucleus: [..., V] logits, [..., C] their C largest,
  descending, top_p broadcastable to [..., 1]."""
  lse = products.ordered_logsumexp(logits)  # The top scaled logit is 0: finite.
  probs = jnp.exp(top - lse)
  cum = jnp.cumsum(probs, axis=-1)
  # Keep a token if the mass before it is < top_p (>= 1 token since top_p > 0).
  num_keep = jnp.sum(cum - probs < top_p, axis=-1, keepdims=True)
  fast = jnp.take_along_axis(top, num_keep - 1, axis=-1)
  if top.shape[-1] == logits.shape[-1]:
    return fast  # The whole row is sorted: always exact.
  fits = (cum[..., -1:] >= top_p) | (top_p >= 1)  # A row without top-p needs no threshold.

  def exact():
    keys = _order_keys(logits)
    t = _largest_threshold(keys, _softmax(logits), top_p)
    return jnp.where(fits, fast, _from_order_keys(t))

  return jax.lax.cond(jnp.all(fits), lambda: fast, exact)


def _order_keys(x: jnp.ndarray) -> jnp.ndarray:
  """float32 -> int32 keys with the same order (NaN aside): flip the magnitude of negatives."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _from_order_keys(keys: jnp.ndarray) -> jnp.ndarray:
  """Inverse of `_order_keys`."""
  bits = jnp.where(keys >= 0, keys, keys ^ jnp.int32(0x7FFFFFFF))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(keys: jnp.ndarray, weights: jnp.ndarray, target) -> jnp.ndarray:
  """Largest key t per row with sum(weights[keys >= t]) >= target, by bisection.

  keys: [..., V] int32, weights: [..., V] -> [..., 1] int32. Keeping keys >= t keeps the
  smallest set of top entries reaching the target, plus ties. If even the whole row falls short
  (float rounding with top_p near 1), t is the row minimum: everything is kept.
  """
  def body(_, bounds):
    lo, hi = bounds  # Answer in [lo, hi]; int32 range, so 32 halvings suffice.
    mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow.
    ok = _row_sum(jnp.where(keys >= mid, weights, 0.0)) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  bounds = (jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True))
  return jax.lax.fori_loop(0, 32, body, bounds)[0]


def target_probs(logits: jnp.ndarray, temperature=1.0, top_k=0, top_p=1.0) -> jnp.ndarray:
  """[B, ..., V] float32 probabilities of the shaped distribution (one-hot argmax if greedy)."""
  return _softmax(shape_logits(logits, temperature, top_k, top_p))


def row_keys(rng, batch_size: int) -> jax.Array:
  """[B] PRNG keys: `rng` itself if it already holds one key per row, else split from it."""
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == (batch_size,):
    return rng
  return jax.random.split(rng, batch_size)


def split_rows(keys: jax.Array, num: int = 2) -> tuple[jax.Array, ...]:
  """[B] keys -> `num` arrays of [B] keys, each row's split from its own key."""
  split = jax.vmap(lambda k: jax.random.split(k, num))(keys)  # [B, num]
  return tuple(split[:, i] for i in range(num))


def all_greedy(temperature, active=None) -> jnp.ndarray:
  """[] bool: whether every (active) row decodes greedily (temperature [B] or a number)."""
  greedy = jnp.asarray(temperature) == 0
  if active is not None:
    greedy = greedy | ~active
  return jnp.all(greedy)


def sample_tokens(rng, logits: jnp.ndarray, temperature=1.0, top_k=0, top_p=1.0,
                  active=None, greedy_only: bool = False) -> jnp.ndarray:
  """Samples one token per row. logits: [B, V] -> [B] int32 (argmax for greedy rows).

  Draws as a verification with no candidates draws its next token (`accept` with nothing
  drafted: the same split of each row's key), so a row's token does not depend on whether its
  step verified drafts.

  rng: [B] keys (one per row) or one key to split. active: [B] rows that matter (None: all);
  when every one of them is greedy, nothing is shaped nor drawn. greedy_only: static, every
  row is greedy (a Python 0 temperature means the same).
  """
  greedy_tokens = argmax_lib.argmax(logits)
  if greedy_only or (isinstance(temperature, numbers.Real) and temperature == 0):
    return greedy_tokens

  def draw():
    _, key_s = split_rows(row_keys(rng, logits.shape[0]))
    probs = target_probs(logits, temperature, top_k, top_p)
    return jnp.where(jnp.asarray(temperature) == 0, greedy_tokens,
                     _sample_from_probs(key_s, probs))

  return jax.lax.cond(all_greedy(temperature, active), lambda: greedy_tokens, draw)


def _sample_from_probs(keys: jax.Array, probs: jnp.ndarray) -> jnp.ndarray:
  """[B, V] non-negative weights (need not sum to 1; some positive in each row) -> [B] int32
  ids drawn in proportion to them, one uniform number per row from its key.

  By inverse CDF: the running sum of each row's blocks of `_DRAW_BLOCK` ids picks a block,
  the running sum within it the id. Only ids of positive weight are drawn, and the sums add in
  a fixed order, so a row draws the same id beside any other rows. (`jax.random.categorical`'s
  Gumbel noise over every id cost 35x as much: 6.5 against 0.18 ms for [8, 49152].)
  """
  b, v = probs.shape
  blocks = -(-v // _DRAW_BLOCK)
  weights = jnp.pad(probs.astype(jnp.float32), ((0, 0), (0, blocks * _DRAW_BLOCK - v)))
  weights = weights.reshape(b, blocks, _DRAW_BLOCK)
  sums = products.ordered_sum(weights, axis=-1)  # [B, blocks]
  running = jnp.cumsum(sums, axis=-1)
  u = jax.vmap(jax.random.uniform)(keys)
  target = u * running[:, -1]
  # The first block whose running sum passes the target (the last that has weight, should
  # rounding carry the target to the total); its own weights then place the target.
  last_block = blocks - 1 - jnp.argmax(sums[:, ::-1] > 0, axis=-1)
  block = jnp.minimum(jnp.sum(running <= target[:, None], axis=-1), last_block)
  before = jnp.where(block > 0, _gather_last(running, jnp.maximum(block - 1, 0)), 0.0)
  inner = kv_cache_lib.gather_rows(weights, block)  # [B, _DRAW_BLOCK]
  last_id = _DRAW_BLOCK - 1 - jnp.argmax(inner[:, ::-1] > 0, axis=-1)
  within = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
  return (block * _DRAW_BLOCK + jnp.minimum(within, last_id)).astype(jnp.int32)


def _gather_last(x: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
  """x[..., idx] per leading index: x [..., V], idx [...] -> [...]."""
  return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def _accept(u: jnp.ndarray, p_x: jnp.ndarray, q_x: jnp.ndarray) -> jnp.ndarray:
  """True with probability min(1, p_x / q_x) for u ~ U[0, 1); never if p_x == 0.

  Written without a division so q_x == 0 (a draft the drafter could not produce) is safe.
  """
  return (p_x > 0) & ((p_x >= q_x) | (u * q_x < p_x))


def _residual(p: jnp.ndarray, q: jnp.ndarray) -> jnp.ndarray:
  """normalize(max(0, p - q)) over the last axis, falling back to p where that is all zero."""
  r = jnp.maximum(p - q, 0.0)
  total = _row_sum(r)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


# ------------------------------------------------------------------------------------------
# Chains: drafts [B, K], one candidate per position.
# ------------------------------------------------------------------------------------------


def greedy_accept_chain(draft: jnp.ndarray, target_logits: jnp.ndarray,
                        num_drafts=None) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Greedy verification of a chain of drafts.

  Args:
    draft: [B, K] int drafted tokens.
    target_logits: [B, K + 1, V]; target_logits[:, i] predicts the token after candidate
      position i (position 0 = last accepted token), so it verifies draft[:, i].
    num_drafts: [B] drafts each row may accept at most (None: K): the rest are not candidates.

  Returns:
    num_accepted: [B] int32 in 0..K, length of the prefix with draft == argmax.
    next_token: [B] int32, the argmax at the first mismatch (or at K, the bonus, if none).
  """
  k = draft.shape[1]
  target = argmax_lib.argmax(target_logits)  # [B, K + 1]
  match = draft.astype(jnp.int32) == target[:, :k]
  if num_drafts is not None:
    match &= jnp.arange(k)[None, :] < num_drafts[:, None]
  num_accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
  next_token = jnp.take_along_axis(target, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted, next_token


def rejection_accept_chain(rng, draft: jnp.ndarray, draft_probs: jnp.ndarray | None,
                           target_probs: jnp.ndarray, num_drafts=None
                           ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Speculative rejection sampling of a chain; the output is distributed exactly as p.

  Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order. At the first
  rejection the next token is drawn from normalize(max(0, p_i - q_i)); if all are accepted it
  is the bonus token drawn from p at the last one.

  Args:
    rng: [B] keys (one per row) or one key to split.
    draft: [B, K] int drafted tokens, x_i ~ q_i.
    draft_probs: [B, K, V] q, the distributions the drafts were drawn from; None means
      deterministic drafts (q_i = one-hot(x_i)), e.g. top-1 heads.
    target_probs: [B, K + 1, V] p, shaped target distributions (see `target_probs`).
    num_drafts: [B] drafts each row may accept at most (None: K); a row with n stops there as
      if it had drafted n (the next token is the bonus drawn from p_n).

  Returns:
    num_accepted: [B] int32 in 0..K.
    next_token: [B] int32.
  """
  b, k = draft.shape
  key_u, key_s = split_rows(row_keys(rng, b))
  draft = draft.astype(jnp.int32)
  p = target_probs.astype(jnp.float32)
  if k == 0:  # Nothing drafted: plain sampling.
    return jnp.zeros((b,), jnp.int32), _sample_from_probs(key_s, p[:, 0])
  limit = jnp.full((b,), k, jnp.int32) if num_drafts is None else num_drafts
  p_x = _gather_last(p[:, :k], draft)  # [B, K]
  if draft_probs is None:
    q_x = jnp.ones_like(p_x)
  else:
    q_x = _gather_last(draft_probs.astype(jnp.float32), draft)
  u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(key_u)
  accepted = _accept(u, p_x, q_x) & (jnp.arange(k)[None, :] < limit[:, None])
  num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

  # Distribution of the next token: residual at the first rejection, p_n when all accepted.
  p_n = kv_cache_lib.gather_rows(p, num_accepted)  # [B, V]
  rejected = num_accepted < limit
  i = jnp.minimum(num_accepted, k - 1)
  if draft_probs is None:
    x = jnp.take_along_axis(draft, i[:, None], axis=1)[:, 0]
    q_n = jax.nn.one_hot(x, p.shape[-1], dtype=jnp.float32)
  else:
    q_n = kv_cache_lib.gather_rows(draft_probs.astype(jnp.float32), i)
  dist = jnp.where(rejected[:, None], _residual(p_n, q_n), p_n)
  return num_accepted, _sample_from_probs(key_s, dist)


# ------------------------------------------------------------------------------------------
# Trees: node_tokens [B, N], node 0 = last accepted token (see trees.py).
# ------------------------------------------------------------------------------------------


def greedy_accept_tree(
    tree: trees_lib.Tree | dynamic_trees.RowTrees, node_tokens: jnp.ndarray,
    target_logits: jnp.ndarray, enabled=None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Greedy verification of a candidate tree.

  A node is accepted iff its token equals the argmax at its parent and its parent is accepted
  (the root always is); the deepest accepted node wins (unique when siblings hold distinct
  tokens; otherwise the lowest node index among the deepest).

  Args:
    tree: static candidate tree with N nodes, or every row's own (`dynamic_trees.RowTrees`).
    node_tokens: [B, N] int; node 0 is not checked.
    target_logits: [B, N, V]; target_logits[:, n] predicts the child of node n.
    enabled: [B, N] bool nodes that are candidates (None: all); a disabled node is never
      accepted (nor are its descendants).

  Returns:
    accepted_path_nodes: [B, depth + 1] int32 node indices root first, padded with -1 after
      the last accepted node (depth = tree.max_depth).
    num_accepted: [B] int32 accepted drafts, root excluded (= depth of the last node).
    next_token: [B] int32 argmax at the last accepted node.
  """
  rows = dynamic_trees.as_rows(tree, node_tokens.shape[0])
  parent = jnp.maximum(rows.parent, 0)  # The root's own entry is overridden below.
  target = argmax_lib.argmax(target_logits)  # [B, N]
  match = node_tokens.astype(jnp.int32) == jnp.take_along_axis(target, parent, axis=1)
  if enabled is not None:
    match &= enabled
  match = match.at[:, 0].set(True)
  accepted = match
  for _ in range(rows.max_depth):  # Acceptance flows one level down per pass.
    accepted = match & jnp.take_along_axis(accepted, parent, axis=1)
  best = jnp.argmax(jnp.where(accepted, rows.depth, -1), axis=1).astype(jnp.int32)
  return _tree_result(rows, best, jnp.take_along_axis(target, best[:, None], axis=1)[:, 0])


def _tree_result(rows: dynamic_trees.RowTrees, node, next_token):
  """(root-first path padded with -1, depth, next_token) of the last accepted node [B]."""
  path = kv_cache_lib.gather_rows(rows.node_paths, node)
  num_accepted = kv_cache_lib.gather_rows(rows.depth, node)
  return path, num_accepted, next_token


def rejection_accept_tree(
    rng, tree: trees_lib.Tree | dynamic_trees.RowTrees, node_tokens: jnp.ndarray,
    target_probs: jnp.ndarray, draft_probs: jnp.ndarray | None = None,
    enabled=None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Multi-candidate speculative rejection sampling on a tree; exact in distribution.

  Per row, from the root with p = target at the root: try the current node's children in rank
  order; child c (token x) is accepted with probability min(1, p(x) / q_c(x)), and on rejection
  p <- normalize(max(0, p - q_c)) before trying the next child. On acceptance move to c with
  p = target at c. When every child is rejected (or at a leaf) sample the next token from p.

  Why exact: one step is ordinary speculative sampling, which returns x ~ p when x is accepted
  or else a draw from the residual; trying the next (independently drafted) child is itself
  speculative sampling of that residual, so by induction the emitted token is ~ p at each node.
  With deterministic drafts q_c = one-hot(x_c): accept x_c w.p. p(x_c), else zero it, renormalise.
  The tree's shape may depend on the drafts (a dynamic tree): it fixes which candidates are
  tried, never how the target's draws fall, so the argument holds node by node. Likewise
  disabled nodes (`enabled`) are simply not tried.

  Args:
    rng: [B] keys (one per row) or one key to split.
    tree: static candidate tree with N nodes, or every row's own (`dynamic_trees.RowTrees`).
    node_tokens: [B, N] int; node 0 is not checked.
    target_probs: [B, N, V] p; target_probs[:, n] is the distribution of n's child.
    draft_probs: [B, N, V] q; draft_probs[:, c] is the distribution child c's token was drawn
      from (siblings drawn independently); None means deterministic one-hot drafts (top-k).
    enabled: [B, N] bool candidate nodes (None: all). Disabled nodes must be whole subtrees
      that come after the enabled children of their parent (a drafter's nodes, hung below the
      root after another's), so that trying children in order stops at the first disabled one.

  Returns:
    accepted_path_nodes: [B, depth + 1] int32 root first, padded with -1.
    num_accepted: [B] int32 accepted drafts, root excluded.
    next_token: [B] int32.
  """
  rows = dynamic_trees.as_rows(tree, node_tokens.shape[0])
  p_all = target_probs.astype(jnp.float32)
  q_all = None if draft_probs is None else draft_probs.astype(jnp.float32)
  return _walk(rng, rows, node_tokens, lambda node: kv_cache_lib.gather_rows(p_all, node),
              None if q_all is None else lambda node: kv_cache_lib.gather_rows(q_all, node),
               enabled)


def _walk(rng, rows: dynamic_trees.RowTrees, node_tokens: jnp.ndarray,
         probs_at: Callable[[jnp.ndarray], jnp.ndarray],
         draft_probs_at: Callable[[jnp.ndarray], jnp.ndarray] | None = None,
         enabled=None, walking=None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """`rejection_accept_tree` given each node's distributions on demand: a level at a time,
  each row tries its node's children in rank order, then moves to the one it accepted, whose
  target `probs_at` gives then ([B] nodes -> [B, V]; only at levels where some row moved).

  A sampled row rarely goes deep, so most of a block's targets are never needed: shaping all
  88 of SmolLM2's 11-node block at batch 8 (top-p's threshold each) cost 69-75 ms on CPU.
  draft_probs_at: as probs_at, for the candidates' draft distributions (None: one-hot).
  walking: [B] rows that walk (None: all); the others' results are meaningless.
  Each row's i-th child test reads its i-th uniform number, as one test per row and step
  would: the walk draws what `rejection_accept_tree` on precomputed targets draws.
  """
  b = node_tokens.shape[0]
  batch = jnp.arange(b)
  key_u, key_s = split_rows(row_keys(rng, b))
  tries = max(rows.max_tries, 1)
  u = jax.vmap(lambda key: jax.random.uniform(key, (tries,)))(key_u)  # [B, tries]
  node_tokens = node_tokens.astype(jnp.int32)
  walking = jnp.ones((b,), bool) if walking is None else walking

  def test(state):
    """Each testing row's `slot`-th child of its node: accepted, or removed from p."""
    slot, cur, test_count, testing, chosen, p = state
    c = jnp.maximum(rows.children[batch, cur, jnp.minimum(slot, rows.max_children - 1)], 0)
    has_child = testing & (slot < rows.num_children[batch, cur])
    if enabled is not None:  # A disabled child ends its parent's children.
      has_child &= enabled[batch, c]
    x = node_tokens[batch, c]
    p_x = _gather_last(p, x)
    if draft_probs_at is None:
      q = (jnp.arange(p.shape[-1]) == x[:, None]).astype(jnp.float32)
      q_x = jnp.ones_like(p_x)
    else:
      q = draft_probs_at(c)
      q_x = _gather_last(q, x)
    acc = has_child & _accept(u[batch, jnp.minimum(test_count, tries - 1)], p_x, q_x)
    rej = has_child & ~acc
    p = jnp.where(rej[:, None], _residual(p, q), p)
    return (slot + 1, cur, test_count + has_child, testing & rej, jnp.where(acc, c, chosen), p)

  def level(state):
    """Rows that arrived at their node take its target (traced once: the programs stay small),
    then try its children; those that accepted one arrive there."""
    cur, test_count, arrived, p = state
    p = jnp.where(arrived[:, None], probs_at(cur), p)
    if not rows.max_children:
      return cur, test_count, jnp.zeros_like(arrived), p
    moved_to = jnp.full((b,), -1, jnp.int32)
    _, _, test_count, _, moved_to, p = jax.lax.while_loop(
        lambda state: (state[0] < rows.max_children) & jnp.any(state[3]), test,
        (0, cur, test_count, arrived, moved_to, p))
    moved = moved_to >= 0
    return jnp.where(moved, moved_to, cur), test_count, moved, p

  cur = jnp.zeros((b,), jnp.int32)
  p = jnp.zeros(jax.eval_shape(probs_at, cur).shape, jnp.float32)
  cur, _, _, p = jax.lax.while_loop(lambda state: jnp.any(state[2]), level,
                                    (cur, jnp.zeros((b,), jnp.int32), walking, p))
  return _tree_result(rows, cur, _sample_from_probs(key_s, p))


# ------------------------------------------------------------------------------------------
# One verification's acceptance, whatever the mix of rows.
# ------------------------------------------------------------------------------------------


def accept(keys: jax.Array, tree: trees_lib.Tree | dynamic_trees.RowTrees,
           node_tokens: jnp.ndarray, logits: jnp.ndarray, settings, *, active: jnp.ndarray,
           enabled: jnp.ndarray | None = None, greedy_only: bool = False
           ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Accepts each row's longest verified path through its block, greedy or sampled per row.

  Args:
    keys: [B] PRNG keys, one per row (unused when every active row is greedy).
    tree: the verified block (a chain is a `Tree` whose `is_chain`).
    node_tokens: [B, N] the block's tokens, node 0 = the last accepted token.
    logits: [B, N, V] the trunk's logits at every node (emittable ids only).
    settings: per-row temperature, top_k, top_p ([B] each).
    active: [B] rows that matter.
    enabled: [B, N] candidate nodes (None: all; see `rejection_accept_tree`).
    greedy_only: static: every row is greedy (the sampler is not even compiled).

  Returns:
    (path [B, depth + 1] accepted node indices root first, padded with the last accepted
    node; num_accepted [B]; next_token [B]).
  """
  chain = isinstance(tree, trees_lib.Tree) and tree.is_chain
  n = node_tokens.shape[1]
  b = node_tokens.shape[0]

  def greedy():
    if chain:
      limit = None if enabled is None else jnp.sum(
          jnp.cumprod(enabled[:, 1:].astype(jnp.int32), axis=1), axis=1)
      num_accepted, next_token = greedy_accept_chain(node_tokens[:, 1:], logits, limit)
      return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), num_accepted, next_token
    return greedy_accept_tree(tree, node_tokens, logits, enabled)

  if greedy_only:
    path, num_accepted, next_token = greedy()
  else:
    greedy_rows = jnp.broadcast_to(jnp.asarray(settings.temperature) == 0, (b,))
    sampled_rows = active & ~greedy_rows
    # Rows that do not walk are shaped as plain samplers: no argmax, top-k or top-p for them.
    settings_now = (jnp.where(sampled_rows, settings.temperature, 1.0),
                    jnp.where(sampled_rows, settings.top_k, 0),
                    jnp.where(sampled_rows, settings.top_p, 1.0))

    def sampled():  # Only the nodes where a sampled row stands are shaped.
      return _walk(keys, dynamic_trees.as_rows(tree, b), node_tokens,
                   lambda node: target_probs(kv_cache_lib.gather_rows(logits, node),
                                             *settings_now),
                   enabled=enabled, walking=sampled_rows)

    def mixed():
      path, num, nxt = sampled()
      if chain:  # The walk's path is padded with -1 after its last node.
        path = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))

      def with_greedy_rows():  # Greedy rows take the greedy rule's (deepest) path.
        greedy_path, greedy_num, greedy_next = greedy()
        return (jnp.where(greedy_rows[:, None], greedy_path, path),
                jnp.where(greedy_rows, greedy_num, num), jnp.where(greedy_rows, greedy_next, nxt))

      return jax.lax.cond(jnp.any(active & greedy_rows), with_greedy_rows,
                          lambda: (path, num, nxt))

    path, num_accepted, next_token = jax.lax.cond(jnp.any(sampled_rows), mixed, greedy)
  if chain:
    return path, num_accepted, next_token
  last_node = kv_cache_lib.gather_rows(path, num_accepted)
  return jnp.where(path >= 0, path, last_node[:, None]), num_accepted, next_token


def token_logprobs(logits: jnp.ndarray, tokens: jnp.ndarray, top: int
                   ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """The model's log-probabilities of `tokens`, and its `top` most likely tokens.

  Args:
    logits: [B, T, V] the trunk's logits (emittable ids only) before each token.
    tokens: [B, T] the tokens that followed.
    top: how many of the most likely tokens to report (0: none).

  Returns:
    (logprob [B, T], top_ids [B, T, top] int32, top_logprobs [B, T, top]); log-probabilities of
    the model's own distribution (temperature 1, no top-k or top-p: what OpenAI's logprobs
    report), in float32.
  """
  x = logits.astype(jnp.float32)
  shifted = x - jnp.max(x, axis=-1, keepdims=True)
  # jax.nn.log_softmax gave a token other bits (1 ulp) in a verification block or a batch than
  # alone: summed in a fixed order, its log-probability is one number however it was decoded.
  log_probs = shifted - jnp.log(_row_sum(jnp.exp(shifted)))
  chosen = _gather_last(log_probs, tokens.astype(jnp.int32))
  if not top:
    empty = jnp.zeros(tokens.shape + (0,))
    return chosen, empty.astype(jnp.int32), empty
  values, ids = jax.lax.top_k(log_probs, top)
  return chosen, ids.astype(jnp.int32), values
