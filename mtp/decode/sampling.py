"""Sampling and exact acceptance rules for self-speculative decoding.

Everything here is a pure, jittable jnp function batched over rows B. Sampling settings
(temperature, top_k, top_p) are static Python numbers: temperature 0 selects the greedy code
path at trace time, so nothing divides by zero.

Acceptance rules verify drafted tokens against the trunk's predictions from one forward pass:
  * greedy: accept the longest run of drafts equal to the trunk's argmax; the output equals plain
    greedy decoding token for token.
  * sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), and its
    multi-candidate form on trees (SpecInfer, Miao et al. 2023); every emitted token is
    distributed exactly as sampling from the target distribution p one token at a time.

Conventions: the target at candidate position i (chain) or node n (tree) is the trunk's
distribution of the token that follows it. Position 0 / node 0 is the last accepted token.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import dynamic_trees
from mtp.decode import trees as trees_lib
from mtp.model import kv_cache as kv_cache_lib

_NEG_INF = -jnp.inf


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


def _is_greedy(temperature) -> bool:
  if not isinstance(temperature, numbers.Real):
    raise TypeError('temperature must be a static Python number (0 selects the greedy code '
                    f'path at trace time), got {type(temperature).__name__}')
  return temperature == 0


def shape_logits(logits: jnp.ndarray, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> jnp.ndarray:
  """Applies temperature, then top-k, then top-p, masking removed tokens to -inf.

  Args:
    logits: [..., V].
    temperature: static; 0 = greedy: every token but the argmax is masked.
    top_k: static; 0 = off. Tokens tied with the k-th largest logit are kept too.
    top_p: static; 1.0 = off; keeps the smallest prefix of the sorted (post top-k)
      distribution whose mass reaches top_p, plus ties with its last logit. The top token
      always stays.

  Returns:
    [..., V] float32 logits of the shaped distribution.
  """
  greedy = _is_greedy(temperature)
  validate_sampling(temperature, top_k, top_p, logits.shape[-1])
  logits = logits.astype(jnp.float32)
  if greedy:
    best = jnp.argmax(logits, axis=-1)
    keep = jnp.arange(logits.shape[-1]) == best[..., None]
    return jnp.where(keep, logits, _NEG_INF)
  if temperature != 1:
    # In a form that stays finite for any temperature > 0: the top logit becomes exactly 0 and
    # the others x / T <= 0, which may underflow to -inf but never gives inf - inf = NaN (a plain
    # softmax(logits / 1e-10) does on float32, and a temperature that rounds to 0 in float32
    # would divide 0 by 0).
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0.0, shifted / jnp.float32(temperature))
  use_k = 0 < top_k < logits.shape[-1]
  use_p = top_p < 1
  if not (use_k or use_p):
    return logits
  if use_k:
    top = jax.lax.top_k(logits, top_k)[0]  # [..., k], descending.
    # min, not top[..., -1:]: XLA rewrites a slice of top_k into a full (slow on CPU) sort.
    logits = jnp.where(logits >= jnp.min(top, axis=-1, keepdims=True), logits, _NEG_INF)
  if use_p:
    if not use_k:
      top = jax.lax.top_k(logits, min(_TOP_P_CANDIDATES, logits.shape[-1]))[0]
    logits = jnp.where(logits >= _top_p_threshold(logits, top, top_p), logits, _NEG_INF)
  return logits


# Top-p looks for its nucleus among this many top logits first (a partial top_k is cheap), and
# falls back to an exact bisection over the whole vocabulary when some row's nucleus is larger.
# A full sort would be simpler but costs 4.4 s on CPU for [192, 49152] logits (top_k(256):
# 0.06 s, bisection: 0.8 s).
_TOP_P_CANDIDATES = 256


def _top_p_threshold(logits: jnp.ndarray, top: jnp.ndarray, top_p: float) -> jnp.ndarray:
  """Smallest logit of the nucleus: [..., V] logits, [..., C] their C largest, descending."""
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  probs = jnp.exp(top - lse)
  cum = jnp.cumsum(probs, axis=-1)
  # Keep a token if the mass before it is < top_p (>= 1 token since top_p > 0).
  num_keep = jnp.sum(cum - probs < top_p, axis=-1, keepdims=True)
  fast = jnp.take_along_axis(top, num_keep - 1, axis=-1)
  if top.shape[-1] == logits.shape[-1]:
    return fast  # The whole row is sorted: always exact.
  fits = cum[..., -1:] >= top_p

  def exact():
    keys = _order_keys(logits)
    t = _largest_threshold(keys, jax.nn.softmax(logits, axis=-1), top_p)
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
    ok = jnp.sum(jnp.where(keys >= mid, weights, 0.0), axis=-1, keepdims=True) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  bounds = (jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True))
  return jax.lax.fori_loop(0, 32, body, bounds)[0]


def target_probs(logits: jnp.ndarray, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> jnp.ndarray:
  """[..., V] float32 probabilities of the shaped distribution (one-hot argmax if greedy)."""
  return jax.nn.softmax(shape_logits(logits, temperature, top_k, top_p), axis=-1)


def sample_tokens(rng: jax.Array, logits: jnp.ndarray, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0) -> jnp.ndarray:
  """Samples one token per row. logits: [B, V] -> [B] int32 (argmax if temperature == 0)."""
  if _is_greedy(temperature):
    validate_sampling(temperature, top_k, top_p, logits.shape[-1])  # Same errors as sampling.
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  shaped = shape_logits(logits, temperature, top_k, top_p)
  return jax.random.categorical(rng, shaped, axis=-1).astype(jnp.int32)


def _sample_from_probs(rng: jax.Array, probs: jnp.ndarray) -> jnp.ndarray:
  """[B, V] non-negative weights (need not sum to 1) -> [B] int32."""
  return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


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
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


# ------------------------------------------------------------------------------------------
# Chains: drafts [B, K], one candidate per position.
# ------------------------------------------------------------------------------------------


def greedy_accept_chain(draft: jnp.ndarray,
                        target_logits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Greedy verification of a chain of drafts.

  Args:
    draft: [B, K] int drafted tokens.
    target_logits: [B, K + 1, V]; target_logits[:, i] predicts the token after candidate
      position i (position 0 = last accepted token), so it verifies draft[:, i].

  Returns:
    num_accepted: [B] int32 in 0..K, length of the prefix with draft == argmax.
    next_token: [B] int32, the argmax at the first mismatch (or at K, the bonus, if none).
  """
  k = draft.shape[1]
  target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
  match = draft.astype(jnp.int32) == target[:, :k]
  num_accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
  next_token = jnp.take_along_axis(target, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted, next_token


def rejection_accept_chain(rng: jax.Array, draft: jnp.ndarray, draft_probs: jnp.ndarray | None,
                           target_probs: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Speculative rejection sampling of a chain; the output is distributed exactly as p.

  Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order. At the first
  rejection the next token is drawn from normalize(max(0, p_i - q_i)); if all K are accepted it
  is the bonus token drawn from p_K.

  Args:
    rng: PRNG key.
    draft: [B, K] int drafted tokens, x_i ~ q_i.
    draft_probs: [B, K, V] q, the distributions the drafts were drawn from; None means
      deterministic drafts (q_i = one-hot(x_i)), e.g. top-1 heads.
    target_probs: [B, K + 1, V] p, shaped target distributions (see `target_probs`).

  Returns:
    num_accepted: [B] int32 in 0..K.
    next_token: [B] int32.
  """
  b, k = draft.shape
  key_u, key_s = jax.random.split(rng)
  draft = draft.astype(jnp.int32)
  p = target_probs.astype(jnp.float32)
  if k == 0:  # Nothing drafted: plain sampling.
    return jnp.zeros((b,), jnp.int32), _sample_from_probs(key_s, p[:, 0])
  p_x = _gather_last(p[:, :k], draft)  # [B, K]
  if draft_probs is None:
    q_x = jnp.ones_like(p_x)
  else:
    q_x = _gather_last(draft_probs.astype(jnp.float32), draft)
  u = jax.random.uniform(key_u, (b, k))
  accepted = _accept(u, p_x, q_x)
  num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

  # Distribution of the next token: residual at the first rejection, p_K when all accepted.
  p_n = kv_cache_lib.gather_rows(p, num_accepted)  # [B, V]
  rejected = num_accepted < k
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
    target_logits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Greedy verification of a candidate tree.

  A node is accepted iff its token equals the argmax at its parent and its parent is accepted
  (the root always is); the deepest accepted node wins (unique when siblings hold distinct
  tokens; otherwise the lowest node index among the deepest).

  Args:
    tree: static candidate tree with N nodes, or every row's own (`dynamic_trees.RowTrees`).
    node_tokens: [B, N] int; node 0 is not checked.
    target_logits: [B, N, V]; target_logits[:, n] predicts the child of node n.

  Returns:
    accepted_path_nodes: [B, depth + 1] int32 node indices root first, padded with -1 after
      the last accepted node (depth = tree.max_depth).
    num_accepted: [B] int32 accepted drafts, root excluded (= depth of the last node).
    next_token: [B] int32 argmax at the last accepted node.
  """
  rows = dynamic_trees.as_rows(tree, node_tokens.shape[0])
  parent = jnp.maximum(rows.parent, 0)  # The root's own entry is overridden below.
  target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
  match = node_tokens.astype(jnp.int32) == jnp.take_along_axis(target, parent, axis=1)
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
    rng: jax.Array, tree: trees_lib.Tree | dynamic_trees.RowTrees, node_tokens: jnp.ndarray,
    target_probs: jnp.ndarray,
    draft_probs: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
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
  tried, never how the target's draws fall, so the argument holds node by node.

  Args:
    rng: PRNG key.
    tree: static candidate tree with N nodes, or every row's own (`dynamic_trees.RowTrees`).
    node_tokens: [B, N] int; node 0 is not checked.
    target_probs: [B, N, V] p; target_probs[:, n] is the distribution of n's child.
    draft_probs: [B, N, V] q; draft_probs[:, c] is the distribution child c's token was drawn
      from (siblings drawn independently); None means deterministic one-hot drafts (top-k).

  Returns:
    accepted_path_nodes: [B, depth + 1] int32 root first, padded with -1.
    num_accepted: [B] int32 accepted drafts, root excluded.
    next_token: [B] int32.
  """
  b, _, v = target_probs.shape
  rows = dynamic_trees.as_rows(tree, b)
  key_u, key_s = jax.random.split(rng)
  p_all = target_probs.astype(jnp.float32)
  q_all = None if draft_probs is None else draft_probs.astype(jnp.float32)
  node_tokens = node_tokens.astype(jnp.int32)
  num_tries = rows.max_tries
  u = jax.random.uniform(key_u, (max(num_tries, 1), b))
  vocab = jnp.arange(v)
  batch = jnp.arange(b)

  # One child test per iteration and row; a rolled loop keeps compile time flat in tree size.
  def body(i, state):
    cur, slot, p = state
    has_child = slot < rows.num_children[batch, cur]  # False once a row has stopped.
    c = jnp.maximum(rows.children[batch, cur, jnp.minimum(slot, rows.max_children - 1)], 0)
    x = jnp.take_along_axis(node_tokens, c[:, None], axis=1)[:, 0]
    p_x = _gather_last(p, x)
    if q_all is None:
      q = (vocab == x[:, None]).astype(jnp.float32)
      q_x = jnp.ones_like(p_x)
    else:
      q = kv_cache_lib.gather_rows(q_all, c)
      q_x = _gather_last(q, x)
    acc = has_child & _accept(u[i], p_x, q_x)
    rej = has_child & ~acc
    p = jnp.where(acc[:, None], kv_cache_lib.gather_rows(p_all, c),
                  jnp.where(rej[:, None], _residual(p, q), p))
    cur = jnp.where(acc, c, cur)
    slot = jnp.where(acc, 0, slot + rej)
    return cur, slot, p

  cur = jnp.zeros((b,), jnp.int32)
  state = (cur, jnp.zeros((b,), jnp.int32), p_all[:, 0])
  if num_tries:
    cur, _, p = jax.lax.fori_loop(0, num_tries, body, state)
  else:
    p = state[2]
  return _tree_result(rows, cur, _sample_from_probs(key_s, p))
