"""Tests for mtp.decode.sampling: sampling transforms and exact acceptance rules.

The statistical tests draw ~200k samples at a fixed seed and compare the emitted tokens with
the target distribution by a chi-square test. Negative controls patch in a wrong residual and
check that the same test rejects it, showing it has the power to catch a real bug.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtp.decode import dynamic_trees
from mtp.decode import sampling
from mtp.decode import trees

PASS_P = 1e-3  # A correct sampler passes at this level (fixed seeds: no flakiness).
FAIL_P = 1e-8  # A wrong one is rejected far below it.
NUM_KEYS, ROWS = 100, 2000  # 200k samples: vmap over keys of batches of rows.


# ------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------


def _dist(rng, shape, scale=1.0):
  """Random distributions over the last axis (float64 numpy)."""
  x = rng.normal(size=shape) * scale
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _chisquare_p(samples, expected):
  """Chi-square p-value of integer samples against expected probabilities (any shape).

  Cells expected to hold < 5 counts are pooled; a sample in a zero-probability cell fails.
  """
  expected = np.asarray(expected, np.float64).ravel()
  samples = np.asarray(samples).ravel()
  obs = np.bincount(samples, minlength=expected.size).astype(np.float64)
  assert obs.size == expected.size
  if np.any(obs[expected == 0] > 0):
    return 0.0
  exp = expected / expected.sum() * samples.size
  small = exp < 5
  obs = np.append(obs[~small], obs[small].sum())
  exp = np.append(exp[~small], exp[small].sum())
  keep = exp > 0
  return stats.chisquare(obs[keep], exp[keep]).pvalue


def _sample_np(rng, probs):
  """One draw per row of probs [..., V] (numpy inverse CDF)."""
  cdf = np.cumsum(probs, -1)
  u = rng.random(probs.shape[:-1] + (1,)) * cdf[..., -1:]
  return np.minimum((u > cdf).sum(-1), probs.shape[-1] - 1)


def _key(seed):
  # RngBitGenerator keys compile much faster on CPU than threefry; the library takes any key.
  return jax.random.key(seed, impl='rbg')


@functools.cache
def _keys():
  return jax.random.split(_key(1234), (NUM_KEYS, 2))


def _vmapped(fn, *args):
  """fn(draft_key, accept_key, *args) -> outputs with ROWS rows; vmapped over NUM_KEYS key
  pairs, returned as numpy arrays concatenated over keys (ROWS * NUM_KEYS samples)."""
  keys = _keys()
  out = jax.jit(jax.vmap(fn, in_axes=(0, 0) + (None,) * len(args)))(keys[:, 0], keys[:, 1], *args)
  return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), out)


def _wrong_residual(p, q):
  """The classic bug: resample from p after a rejection instead of max(0, p - q).

  Patched in with monkeypatch; only freshly traced functions (as in `_vmapped`) see it.
  """
  del q
  return p


# ------------------------------------------------------------------------------------------
# Validation and shaping.
# ------------------------------------------------------------------------------------------


def test_validate_sampling():
  sampling.validate_sampling(0.0, 0, 1.0, 10)
  sampling.validate_sampling(0.7, 10, 0.9, 10)
  with pytest.raises(ValueError, match='temperature.*-0.5'):
    sampling.validate_sampling(-0.5, 0, 1.0, 10)
  with pytest.raises(ValueError, match='temperature.*nan'):
    sampling.validate_sampling(float('nan'), 0, 1.0, 10)
  for bad in (0.0, 1.5, -0.1):
    with pytest.raises(ValueError, match=f'top_p.*{bad}'):
      sampling.validate_sampling(1.0, 0, bad, 10)
  with pytest.raises(ValueError, match='top_k.*-1'):
    sampling.validate_sampling(1.0, -1, 1.0, 10)
  with pytest.raises(ValueError, match='top_k.*vocabulary size 10.*11'):
    sampling.validate_sampling(1.0, 11, 1.0, 10)
  with pytest.raises(ValueError, match='top_k.*2.5'):
    sampling.validate_sampling(1.0, 2.5, 1.0, 10)
  # Inside the loop settings are data: a top_k at or above the vocabulary keeps every token.
  np.testing.assert_array_equal(sampling.shape_logits(jnp.zeros((2, 4)), 1.0, top_k=5), 0.0)


_target_probs = jax.jit(sampling.target_probs, static_argnums=(1, 2, 3))
_greedy_chain = jax.jit(sampling.greedy_accept_chain)
_rejection_chain = jax.jit(sampling.rejection_accept_chain)
_greedy_tree = jax.jit(sampling.greedy_accept_tree, static_argnums=0)
_rejection_tree = jax.jit(sampling.rejection_accept_tree, static_argnums=1)


def test_shape_logits_temperature_and_greedy():
  logits = np.array([[1.0, 3.0, 2.0, -1.0], [0.5, 0.0, 0.2, 0.4]], np.float32)

  def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  np.testing.assert_allclose(_target_probs(logits, 2.0, 0, 1.0), softmax(logits / 2), rtol=1e-5)
  np.testing.assert_allclose(_target_probs(logits, 1.0, 0, 1.0), softmax(logits), rtol=1e-5)
  greedy = _target_probs(logits, 0.0, 0, 1.0)
  np.testing.assert_array_equal(greedy, [[0, 1, 0, 0], [1, 0, 0, 0]])
  shaped = jax.jit(sampling.shape_logits, static_argnums=1)(logits, 0.0)
  assert np.all(np.isfinite(shaped) == (greedy > 0))
  # Traced settings, one per row: a greedy row and a sampled one in one call.
  per_row = jax.jit(sampling.target_probs)(logits, jnp.asarray([0.0, 2.0]),
                                           jnp.asarray([0, 0]), jnp.asarray([1.0, 1.0]))
  np.testing.assert_array_equal(per_row[0], greedy[0])
  np.testing.assert_allclose(per_row[1], softmax(logits[1] / 2), rtol=1e-5)


def test_per_row_top_k_and_top_p_match_each_rows_own():
  """Every row keeps exactly what it would keep alone, top-k past the candidates included."""
  rng = np.random.default_rng(5)
  logits = np.round(rng.normal(size=(6, 1000)), 1).astype(np.float32)
  top_k = np.array([0, 3, 300, 0, 50, 1000], np.int32)
  top_p = np.array([0.9, 1.0, 1.0, 0.5, 0.8, 1.0], np.float32)
  got = np.asarray(jax.jit(sampling.target_probs)(logits, jnp.ones(6), top_k, top_p)) > 0
  for row in range(6):
    np.testing.assert_array_equal(
        got[row], _reference_mask(logits[row:row + 1], int(top_k[row]) % 1000,
                                  float(top_p[row]))[0], err_msg=f'row {row}')


def test_top_k_and_top_p():
  probs = np.array([0.05, 0.5, 0.15, 0.3])
  logits = np.log(probs).astype(np.float32)[None]
  top2 = [[0, 0.5 / 0.8, 0, 0.3 / 0.8]]
  np.testing.assert_allclose(_target_probs(logits, 1.0, 2, 1.0), top2, rtol=1e-5)
  # top_p: smallest prefix of sorted probs reaching the mass (0.5, 0.8, 0.95, 1.0).
  np.testing.assert_allclose(_target_probs(logits, 1.0, 0, 0.7), top2, rtol=1e-5)
  np.testing.assert_allclose(_target_probs(logits, 1.0, 0, 0.85),
                             [[0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]], rtol=1e-5)
  np.testing.assert_allclose(_target_probs(logits, 1.0, 0, 1e-6), [[0, 1, 0, 0]])
  # top-p applies to the top-k renormalised distribution: (0.5, 0.3, 0.15) / 0.95.
  np.testing.assert_allclose(_target_probs(logits, 1.0, 3, 0.8), top2, rtol=1e-5)
  np.testing.assert_allclose(_target_probs(logits, 1.0, 4, 1.0), [probs], rtol=1e-5)
  # Leading batch dimensions and bf16 inputs work.
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 50)), jnp.bfloat16)
  out = np.asarray(_target_probs(x, 0.8, 5, 0.9))
  assert out.shape == (2, 3, 50) and out.dtype == np.float32
  assert np.all((out > 0).sum(-1) <= 5) and np.all((out > 0).sum(-1) >= 1)
  np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-5)


def _reference_mask(logits, top_k, top_p):
  """Kept tokens by sorting in numpy (float64): top-k, then top-p on the renormalised rest."""
  keep = np.ones(logits.shape, bool)
  if top_k:
    kth = -np.sort(-logits, -1)[..., top_k - 1:top_k]
    keep &= logits >= kth
  if top_p < 1:
    x = np.where(keep, logits.astype(np.float64), -np.inf)
    order = np.argsort(-x, -1, kind='stable')
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    sorted_p = np.take_along_axis(probs, order, -1)
    num_keep = np.sum(np.cumsum(sorted_p, -1) - sorted_p < top_p, -1, keepdims=True)
    last = np.take_along_axis(np.take_along_axis(x, order, -1), num_keep - 1, -1)
    keep &= x >= last
  return keep


@pytest.mark.parametrize('top_k,top_p,vocab', [
    (7, 1.0, 100), (0, 0.999, 100), (40, 0.5, 100), (0, 0.9, 1000), (300, 0.95, 1000)])
def test_top_k_top_p_match_sorting_reference(top_k, top_p, vocab):
  rng = np.random.default_rng(top_k + vocab)
  # Rounded logits make ties; -inf entries (masked vocabulary) and negatives included.
  scale = np.where(np.arange(64) % 2 == 0, 0.3, 4.0)[:, None]  # Flat and peaked rows.
  logits = np.round(rng.normal(size=(64, vocab)) * scale, 1).astype(np.float32)
  logits[:, -3:] = -np.inf
  logits[:4] = np.linspace(-5, 5, vocab, dtype=np.float32)[::-1]  # Sorted rows: no ties.
  got = np.asarray(_target_probs(logits, 1.0, top_k, top_p)) > 0
  np.testing.assert_array_equal(got, _reference_mask(logits, top_k, top_p))
  if vocab > sampling._TOP_CANDIDATES and top_p < 1 and top_k == 0:
    # Peaked rows alone: every nucleus fits in the candidates (the branch without bisection).
    peaked = logits[1::2]
    got = np.asarray(_target_probs(peaked, 1.0, top_k, top_p)) > 0
    assert got.sum(-1).max() < sampling._TOP_CANDIDATES
    np.testing.assert_array_equal(got, _reference_mask(peaked, top_k, top_p))


def test_sample_tokens():
  logits = np.random.default_rng(0).normal(size=(6, 9)).astype(np.float32)
  greedy = jax.jit(sampling.sample_tokens, static_argnums=2)(_key(1), logits, 0.0)
  np.testing.assert_array_equal(greedy, np.argmax(logits, -1))
  assert greedy.dtype == jnp.int32
  # Sampled frequencies match the shaped distribution (and never leave the top-k).
  row = np.log(np.array([0.1, 0.4, 0.05, 0.25, 0.2], np.float32))
  samples = _vmapped(
      lambda _, key, row: sampling.sample_tokens(key, jnp.tile(row, (ROWS, 1)), 0.9, top_k=3),
      row)
  expected = np.asarray(_target_probs(row, 0.9, 3, 1.0))
  assert _chisquare_p(samples, expected) > PASS_P
  untruncated = np.exp(row / 0.9) / np.exp(row / 0.9).sum()
  assert _chisquare_p(samples, untruncated) < FAIL_P


# ------------------------------------------------------------------------------------------
# Greedy chains.
# ------------------------------------------------------------------------------------------


def _logits_for(argmax_tokens, v, seed=7):
  """[B, T] tokens -> [B, T, V] random logits whose argmax is those tokens."""
  argmax_tokens = np.asarray(argmax_tokens)
  x = np.random.default_rng(seed).random(argmax_tokens.shape + (v,))
  return (x + 2.0 * np.eye(v)[argmax_tokens]).astype(np.float32)


def test_greedy_accept_chain_hand_made():
  target = np.array([[1, 2, 3, 4],   # all match: bonus at K
                     [1, 5, 3, 4],   # mismatch at 1
                     [9, 2, 3, 4],   # mismatch at 0
                     [1, 2, 7, 6]])  # mismatch at 2
  draft = np.array([[1, 2, 3]] * 4, np.int32)
  n, nxt = _greedy_chain(draft, _logits_for(target, 10))
  np.testing.assert_array_equal(n, [3, 1, 0, 2])
  np.testing.assert_array_equal(nxt, [4, 5, 9, 7])
  assert n.dtype == jnp.int32 and nxt.dtype == jnp.int32


def test_greedy_accept_chain_oracle_and_adversarial():
  b, k, v = 16, 4, 32
  logits = np.random.default_rng(3).normal(size=(b, k + 1, v)).astype(np.float32)
  oracle = np.argmax(logits[:, :k], -1).astype(np.int32)
  n, nxt = _greedy_chain(oracle, logits)
  np.testing.assert_array_equal(n, k)
  np.testing.assert_array_equal(nxt, np.argmax(logits[:, k], -1))
  adversarial = np.argmin(logits[:, :k], -1).astype(np.int32)
  n, nxt = _greedy_chain(adversarial, logits)
  np.testing.assert_array_equal(n, 0)
  np.testing.assert_array_equal(nxt, np.argmax(logits[:, 0], -1))


def test_rejection_chain_with_greedy_target_is_greedy():
  b, k, v = 64, 3, 6
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
  draft = rng.integers(0, v, (b, k)).astype(np.int32)
  # Even rows draft the argmax: long accepted runs too.
  draft[::2] = np.argmax(logits[::2, :k], -1)
  draft[::4, 2] = (draft[::4, 2] + 1) % v
  want = _greedy_chain(draft, logits)
  p = _target_probs(logits, 0.0, 0, 1.0)
  q = _dist(rng, (b, k, v)).astype(np.float32)
  for draft_probs in (None, q):
    got = _rejection_chain(_key(6), draft, draft_probs, p)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
  assert set(np.asarray(want[0]).tolist()) == {0, 1, 2, 3}


def test_rejection_chain_oracle_and_adversarial():
  b, k, v = 32, 3, 8
  rng = np.random.default_rng(0)
  p = _dist(rng, (b, k + 1, v))
  p[:, :, 0] = 0.0  # Token 0 is impossible: never accepted.
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  n, nxt = _rejection_chain(_key(1), np.zeros((b, k), np.int32), None, p)
  np.testing.assert_array_equal(n, 0)
  assert np.all(np.asarray(nxt) != 0)
  # Drafts sampled from q = p are always accepted (min(1, p / q) = 1).
  draft = _sample_np(rng, p[:, :k]).astype(np.int32)
  n, _ = _rejection_chain(_key(3), draft, p[:, :k], p)
  np.testing.assert_array_equal(n, k)


# ------------------------------------------------------------------------------------------
# Rejection sampling on chains: statistical exactness.
# ------------------------------------------------------------------------------------------


def _chain_samples(dists, deterministic):
  """K = 2 chain with context-dependent targets p0, p1[x0], p2[x0, x1] and drafts q0, q1[x0].

  Returns [S, 3]: the emitted sequence (accepted drafts + next token), completed to three
  tokens by sampling the sequential target where it is shorter; and num_accepted [S].
  """
  p0, p1, p2, q0, q1 = dists
  v = p0.shape[0]

  def run(kd, ka, tp0, tp1, tp2, dq0, dq1):
    if deterministic:  # Top-1 drafts (here the target's mode), one-hot draft distributions.
      x0 = jnp.full((ROWS,), jnp.argmax(tp0))
      x1 = jnp.argmax(tp1[x0], -1)
      q = None
    else:
      k0, k1 = jax.random.split(kd)
      x0 = jax.random.categorical(k0, jnp.log(dq0), shape=(ROWS,))
      x1 = jax.random.categorical(k1, jnp.log(dq1[x0]))
      q = jnp.stack([jnp.broadcast_to(dq0, (ROWS, v)), dq1[x0]], 1)
    draft = jnp.stack([x0, x1], 1)
    p = jnp.stack([jnp.broadcast_to(tp0, (ROWS, v)), tp1[x0], tp2[x0, x1]], 1)
    return (draft,) + sampling.rejection_accept_chain(ka, draft, q, p)

  draft, n, nxt = _vmapped(run, *(x.astype(np.float32) for x in dists))
  seq = np.concatenate([draft, np.zeros_like(draft[:, :1])], 1)
  seq[np.arange(len(n)), n] = nxt
  rng = np.random.default_rng(1)
  y1 = _sample_np(rng, p1[seq[:, 0]])
  seq[:, 1] = np.where(n >= 1, seq[:, 1], y1)
  y2 = _sample_np(rng, p2[seq[:, 0], seq[:, 1]])
  seq[:, 2] = np.where(n >= 2, seq[:, 2], y2)
  return seq, n


def _chain_dists(seed=2, v=5):
  rng = np.random.default_rng(seed)
  return (_dist(rng, (v,)), _dist(rng, (v, v)), _dist(rng, (v, v, v)),
          _dist(rng, (v,), 1.5), _dist(rng, (v, v), 1.5))


def _chain_p_values(dists, seq):
  p0, p1, p2 = dists[:3]
  v = p0.shape[0]
  joint = p0[:, None, None] * p1[:, :, None] * p2
  cells = seq[:, 0] * v * v + seq[:, 1] * v + seq[:, 2]
  return _chisquare_p(seq[:, 0], p0), _chisquare_p(cells, joint)


@pytest.mark.parametrize('deterministic', [False, True])
def test_rejection_chain_matches_target(deterministic):
  dists = _chain_dists()
  seq, n = _chain_samples(dists, deterministic)
  assert np.all(np.bincount(n, minlength=3) > 5_000)  # Every outcome is exercised.
  first, joint = _chain_p_values(dists, seq)
  assert first > PASS_P and joint > PASS_P


def test_rejection_chain_wrong_residual_is_caught(monkeypatch):
  """Negative control: resampling from p after a rejection must fail the same test."""
  monkeypatch.setattr(sampling, '_residual', _wrong_residual)
  dists = _chain_dists()
  first, joint = _chain_p_values(dists, _chain_samples(dists, deterministic=False)[0])
  assert first < FAIL_P and joint < FAIL_P


# ------------------------------------------------------------------------------------------
# Trees.
# ------------------------------------------------------------------------------------------

EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _greedy_tree_reference(tree, node_tokens, target_logits):
  """Per row in Python: accept nodes matching the argmax at their accepted parent; return the
  deepest (lowest index among equals) with its root-first path."""
  target = np.argmax(np.asarray(target_logits), -1)
  out = []
  for b in range(node_tokens.shape[0]):
    accepted = [0]
    for n in range(1, tree.num_nodes):
      par = tree.parent[n]
      if par in accepted and node_tokens[b, n] == target[b, par]:
        accepted.append(n)
    best = max(accepted, key=lambda n: (tree.depth[n], -n))
    path, node = [], best
    while node >= 0:
      path.insert(0, node)
      node = tree.parent[node]
    out.append((path + [-1] * (tree.max_depth + 1 - len(path)), len(path) - 1, target[b, best]))
  return [np.array(x) for x in zip(*out)]


def _distinct_sibling_tokens(rng, tree, b, v):
  """[B, N] tokens where siblings hold distinct tokens (as top-k candidates do)."""
  tokens = np.zeros((b, tree.num_nodes), np.int32)
  for par in range(tree.num_nodes):
    kids = tree.children[par][tree.children[par] >= 0]
    if len(kids):
      tokens[:, kids] = np.argsort(rng.random((b, v)), -1)[:, :len(kids)]
  return tokens


def test_greedy_accept_tree_hand_made():
  t = trees.tree_from_choices(EXAMPLE)
  # Nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0).
  tokens = np.array([[0, 11, 12, 13, 14, 15, 16]] * 4, np.int32)
  argmax = np.array([
      [11, 13, 15, 16, 20, 21, 22],  # 11 -> 13 -> 16: all of depth 3, bonus 22
      [12, 13, 15, 16, 20, 21, 22],  # 12 -> 15: deepest matching branch is (1, 0)
      [11, 14, 15, 16, 23, 21, 22],  # 11 -> 14 (second child), next 23
      [30, 13, 15, 16, 20, 21, 22],  # nothing: next 30
  ])
  path, n, nxt = _greedy_tree(t, tokens, _logits_for(argmax, 32))
  np.testing.assert_array_equal(path, [[0, 1, 3, 6], [0, 2, 5, -1], [0, 1, 4, -1],
                                       [0, -1, -1, -1]])
  np.testing.assert_array_equal(n, [3, 2, 2, 0])
  np.testing.assert_array_equal(nxt, [22, 21, 23, 30])
  assert path.dtype == n.dtype == nxt.dtype == jnp.int32


def test_greedy_accept_tree_random_vs_reference():
  t = trees.medusa_default_tree()
  b, v = 256, 4  # Tiny vocab: many partial matches, duplicate siblings included.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(b, t.num_nodes, v)).astype(np.float32)
  tokens = rng.integers(0, v, (b, t.num_nodes)).astype(np.int32)
  got = _greedy_tree(t, tokens, logits)
  want = _greedy_tree_reference(t, tokens, logits)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert len(set(np.asarray(got[1]).tolist())) >= 3


def test_greedy_tree_oracle_adversarial_and_chain():
  k, b, v = 3, 8, 16
  t = trees.chain_tree(k)
  logits = np.random.default_rng(2).normal(size=(b, k + 1, v)).astype(np.float32)
  oracle = np.concatenate([np.zeros((b, 1)), np.argmax(logits[:, :k], -1)], 1).astype(np.int32)
  path, n, nxt = _greedy_tree(t, oracle, logits)
  np.testing.assert_array_equal(n, k)
  np.testing.assert_array_equal(path, np.tile(np.arange(k + 1), (b, 1)))
  np.testing.assert_array_equal(nxt, np.argmax(logits[:, k], -1))
  adversarial = oracle.copy()
  adversarial[:, 1:] = np.argmin(logits[:, :k], -1)
  path, n, nxt = _greedy_tree(t, adversarial, logits)
  np.testing.assert_array_equal(n, 0)
  np.testing.assert_array_equal(nxt, np.argmax(logits[:, 0], -1))
  # Chain as a tree agrees with the chain fast path.
  tokens = np.where(np.arange(b)[:, None] < 4, oracle, adversarial)
  tokens[0, 3] = adversarial[0, 3]
  _, n_tree, nxt_tree = _greedy_tree(t, tokens, logits)
  n_chain, nxt_chain = _greedy_chain(tokens[:, 1:], logits)
  np.testing.assert_array_equal(n_tree, n_chain)
  np.testing.assert_array_equal(nxt_tree, nxt_chain)
  assert set(np.asarray(n_chain).tolist()) == {0, 2, 3}


def test_rejection_tree_with_greedy_target_is_greedy():
  t = trees.medusa_default_tree()
  b, v = 256, 6
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(b, t.num_nodes, v)).astype(np.float32)
  tokens = _distinct_sibling_tokens(rng, t, b, v)
  want = _greedy_tree(t, tokens, logits)
  got = _rejection_tree(_key(3), t, tokens, _target_probs(logits, 0.0, 0, 1.0))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert len(set(np.asarray(want[1]).tolist())) >= 3


# Statistical test tree: three siblings at depth 1, children at depth 2.
STAT_TREE = trees.tree_from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
# Nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0, 0), 5 (0, 1), 6 (1, 0).
STAT_TOKENS = np.array([0, 2, 0, 4, 1, 3, 1], np.int32)


def _tree_samples(p0, p1, p2, q=None):
  """Runs rejection_accept_tree on STAT_TREE; returns [S, 2] first two emitted tokens,
  completed by the sequential target where only one was emitted, and num_accepted."""
  tree = STAT_TREE
  v = p0.shape[0]
  tp0, tp1, tp2 = (jnp.asarray(x, jnp.float32) for x in (p0, p1, p2))
  depth1 = np.nonzero(tree.depth == 1)[0]
  depth2 = np.nonzero(tree.depth == 2)[0]

  def run(kd, ka):
    if q is None:  # Deterministic distinct candidates.
      tokens = jnp.broadcast_to(jnp.asarray(STAT_TOKENS), (ROWS, tree.num_nodes))
      draft_probs = None
    else:  # Every node's token drawn independently from q (duplicates allowed).
      draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (ROWS, tree.num_nodes, v))
      tokens = jax.random.categorical(kd, jnp.log(draft_probs))
    # Node n's target is the distribution of the token after its path's tokens.
    p_nodes = jnp.concatenate([
        jnp.broadcast_to(tp0, (ROWS, 1, v)), tp1[tokens[:, depth1]],
        tp2[tokens[:, tree.parent[depth2]], tokens[:, depth2]]], 1)
    path, n, nxt = sampling.rejection_accept_tree(ka, tree, tokens, p_nodes, draft_probs)
    path_tok = jnp.take_along_axis(tokens, jnp.maximum(path, 0), 1)
    return path_tok, n, nxt

  path_tok, n, nxt = _vmapped(run)
  seq = np.concatenate([path_tok[:, 1:], np.zeros_like(path_tok[:, :1])], 1)
  seq[np.arange(len(n)), n] = nxt
  y1 = _sample_np(np.random.default_rng(5), p1[seq[:, 0]])
  seq[:, 1] = np.where(n >= 1, seq[:, 1], y1)
  return seq[:, :2], n


def _tree_dists(seed):
  rng = np.random.default_rng(seed)
  v = 6
  p0, p1, p2 = _dist(rng, (v,)), _dist(rng, (v, v)), _dist(rng, (v, v, v))
  # Give the drafted tokens real mass so every branch is exercised.
  p0[[2, 0, 4]] += [0.4, 0.25, 0.15]
  p1[2, [1, 3]] += 0.5
  p1[0, 1] += 0.5
  p0 /= p0.sum()
  p1 /= p1.sum(-1, keepdims=True)
  return p0, p1, p2


def test_rejection_tree_deterministic_matches_target(monkeypatch):
  p0, p1, p2 = _tree_dists(0)
  v = p0.shape[0]
  seq, n = _tree_samples(p0, p1, p2)
  assert np.all(np.bincount(n, minlength=3) > 10_000)
  assert set(np.unique(seq[n >= 1, 0])) == {0, 2, 4}  # Every depth-1 sibling gets accepted.
  assert _chisquare_p(seq[:, 0], p0) > PASS_P
  assert _chisquare_p(seq[:, 0] * v + seq[:, 1], p0[:, None] * p1) > PASS_P
  # Negative control: not removing rejected siblings from p over-samples them.
  monkeypatch.setattr(sampling, '_residual', _wrong_residual)
  seq, _ = _tree_samples(p0, p1, p2)
  assert _chisquare_p(seq[:, 0], p0) < FAIL_P
  assert _chisquare_p(seq[:, 0] * v + seq[:, 1], p0[:, None] * p1) < FAIL_P


def test_rejection_tree_sampled_candidates_matches_target():
  p0, p1, p2 = _tree_dists(1)
  v = p0.shape[0]
  q = _dist(np.random.default_rng(3), (v,), 1.5)
  seq, n = _tree_samples(p0, p1, p2, q)
  assert np.all(np.bincount(n, minlength=3) > 5_000)
  assert _chisquare_p(seq[:, 0], p0) > PASS_P
  assert _chisquare_p(seq[:, 0] * v + seq[:, 1], p0[:, None] * p1) > PASS_P


def test_rejection_tree_outputs():
  t = trees.medusa_default_tree()
  b, v = 32, 11
  rng = np.random.default_rng(0)
  probs = _dist(rng, (b, t.num_nodes, v), 2.0).astype(np.float32)
  tokens = rng.integers(0, v, (b, t.num_nodes)).astype(np.int32)
  for draft_probs in (None, probs):
    path, n, nxt = map(np.asarray, _rejection_tree(_key(2), t, tokens, probs,
                                                   draft_probs))
    assert path.shape == (b, t.max_depth + 1) and n.shape == (b,) and nxt.shape == (b,)
    assert path.dtype == n.dtype == nxt.dtype == np.int32
    for row in range(b):  # A real root-first path of n + 1 nodes, each matching its parent.
      last = path[row, n[row]]
      np.testing.assert_array_equal(path[row], t.node_paths[last])
      assert np.all(path[row, n[row] + 1:] == -1)
    assert n.max() >= 2
  # A root-only tree just samples from the root.
  root = trees.chain_tree(0)
  path, n, nxt = _rejection_tree(_key(0), root, tokens[:, :1], probs[:, :1])
  np.testing.assert_array_equal(path, 0)
  np.testing.assert_array_equal(n, 0)


def test_draws_follow_the_weights_across_blocks_and_never_pick_a_zero():
  """The inverse-CDF draw over blocks of ids: unnormalised weights, a last block cut short,
  blocks and ids of zero weight (never drawn), a row with one id of weight."""
  v = 2 * sampling._DRAW_BLOCK + 100
  rng = np.random.default_rng(0)
  weights = rng.random(v) * 3
  weights[rng.random(v) < 0.5] = 0  # Zero ids inside blocks...
  weights[:sampling._DRAW_BLOCK] = 0  # ...a whole block of them...
  weights[-1] = 2.0  # ...and the very last id.
  draws = _vmapped(lambda _, key, w: sampling._sample_from_probs(
      sampling.row_keys(key, ROWS), jnp.tile(w, (ROWS, 1))), jnp.asarray(weights, jnp.float32))
  assert _chisquare_p(draws, weights / weights.sum()) > PASS_P
  wrong = np.roll(weights, 1)  # Off by one id.
  assert _chisquare_p(draws, wrong / wrong.sum()) < FAIL_P
  single = np.zeros((3, v), np.float32)
  single[[0, 1, 2], [0, v - 1, 300]] = [1e-30, 5.0, 1.0]
  np.testing.assert_array_equal(
      jax.jit(sampling._sample_from_probs)(sampling.row_keys(_key(1), 3), single), [0, v - 1, 300])


def _per_try_reference(rng, tree, node_tokens, target_probs):
  """Rejection sampling on a tree, one child test per row and step over every node's target
  computed beforehand (the sampler's earlier form): what `accept` must draw for sampled rows."""
  b, _, v = target_probs.shape
  rows = dynamic_trees.as_rows(tree, b)
  key_u, key_s = sampling.split_rows(sampling.row_keys(rng, b))
  u = jax.vmap(lambda key: jax.random.uniform(key, (max(rows.max_tries, 1),)))(key_u).T
  batch = jnp.arange(b)

  def body(i, state):
    cur, slot, p = state
    c = jnp.maximum(rows.children[batch, cur, jnp.minimum(slot, rows.max_children - 1)], 0)
    has_child = slot < rows.num_children[batch, cur]
    x = node_tokens[batch, c]
    q = (jnp.arange(v) == x[:, None]).astype(jnp.float32)
    p_x = jnp.take_along_axis(p, x[:, None], 1)[:, 0]
    acc = has_child & sampling._accept(u[i], p_x, jnp.ones_like(p_x))
    rej = has_child & ~acc
    p = jnp.where(acc[:, None], target_probs[batch, c],
                  jnp.where(rej[:, None], sampling._residual(p, q), p))
    return (jnp.where(acc, c, cur),
            jnp.where(acc, 0, jnp.where(has_child, slot + rej, rows.max_children + 1)), p)

  cur, _, p = jax.lax.fori_loop(0, rows.max_tries, body,
                                (jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
                                 target_probs[:, 0]))
  return rows.depth[batch, cur], sampling._sample_from_probs(key_s, p)


@pytest.mark.parametrize('shape', ['medusa', 'chain'])
def test_accept_draws_what_a_walk_over_every_nodes_target_draws(shape):
  """`accept` shapes only the nodes a sampled row reaches; it must draw, row for row and key
  for key, what rejection sampling over every node's target draws, whatever the row's settings
  (greedy rows: the greedy rule)."""
  tree = trees.medusa_default_tree() if shape == 'medusa' else trees.chain_tree(5)
  b, v = 12, 50
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(b, tree.num_nodes, v)) * 3, jnp.float32)
  # Drafts the target often agrees with, so that walks go deep.
  tokens = np.asarray(_distinct_sibling_tokens(rng, tree, b, v))
  best = np.asarray(jnp.argmax(logits, -1))
  for n in range(1, tree.num_nodes):
    if tree.children[tree.parent[n]][0] == n:
      tokens[:, n] = np.where(rng.random(b) < 0.7, best[:, tree.parent[n]], tokens[:, n])
  tokens = jnp.asarray(tokens)

  class Settings:
    temperature = jnp.array([0, 0.3, 0.7, 1.0, 1.3, 0.9, 0, 1.0, 0.5, 1.0, 0.8, 2.0])
    top_k = jnp.array([0, 0, 0, 5, 0, 3, 0, 0, 2, 0, 0, 10])
    top_p = jnp.array([1, 1, 0.9, 1, 0.8, 1, 0.5, 0.95, 1, 0.3, 1, 0.99])

  sampled = np.asarray(Settings.temperature) > 0
  accept = jax.jit(lambda key: sampling.accept(
      sampling.row_keys(key, b), tree, tokens, logits, Settings, active=jnp.ones(b, bool)))
  probs = jax.jit(sampling.target_probs)(logits, Settings.temperature[:, None],
                                         Settings.top_k[:, None], Settings.top_p[:, None])
  reference = jax.jit(lambda key: _per_try_reference(sampling.row_keys(key, b), tree, tokens,
                                                     probs))
  if tree.is_chain:  # Chains have a vectorised form of their own.
    reference = jax.jit(lambda key: sampling.rejection_accept_chain(
        sampling.row_keys(key, b), tokens[:, 1:], None, probs))
  greedy = _greedy_tree(tree, tokens, logits)
  depths = []
  for seed in range(40):
    _, num, nxt = map(np.asarray, accept(_key(seed)))
    want_num, want_next = map(np.asarray, reference(_key(seed)))
    np.testing.assert_array_equal(num[sampled], want_num[sampled])
    np.testing.assert_array_equal(nxt[sampled], want_next[sampled])
    np.testing.assert_array_equal(num[~sampled], np.asarray(greedy[1])[~sampled])
    np.testing.assert_array_equal(nxt[~sampled], np.asarray(greedy[2])[~sampled])
    depths.append(num[sampled])
  assert np.max(depths) >= 3 and np.min(depths) == 0  # Deep walks and early stops both ran.


@pytest.mark.parametrize('vocab', [61, 4099, 49152])
def test_a_rows_probabilities_have_the_same_bits_alone_in_a_batch_and_in_a_block(vocab):
  """Shaped probabilities, residuals and log-probabilities of a row do not depend on the rows
  beside it or on the nodes of its block: its seed then draws the same tokens in a shared batch
  as alone (where the logits are row-invariant: half precision on CPU)."""
  logits, other = (jnp.asarray(np.random.default_rng(seed).normal(size=(6, 5, vocab)) * 4,
                               jnp.float32) for seed in (3, 4))
  temperature = jnp.array([0.7, 1.0, 1.3, 0.5, 0.9, 1.0])[:, None]
  top_p = jnp.array([0.9, 1.0, 0.5, 0.99, 1.0, 0.8])[:, None]
  top_k = jnp.array([0, 0, 5, 0, 40, 0])[:, None]

  def each(fn, *arrays):
    whole = jax.jit(fn)(*arrays)
    alone = jnp.stack([jnp.concatenate([jax.jit(fn)(*(a[b:b + 1, n:n + 1] for a in arrays))
                                        for n in range(5)], axis=1)[0] for b in range(6)])
    return np.asarray(whole), np.asarray(alone)

  for whole, alone in (
      each(lambda x, t, k, p: sampling.target_probs(x, t, k, p), logits,
           jnp.broadcast_to(temperature, (6, 5)), jnp.broadcast_to(top_k, (6, 5)),
           jnp.broadcast_to(top_p, (6, 5))),
      each(lambda x, y: sampling._residual(sampling._softmax(x), sampling._softmax(y)), logits,
           other),
      each(lambda x, t: sampling.token_logprobs(x, t, 3)[0], logits,
           jnp.zeros((6, 5), jnp.int32))):
    np.testing.assert_array_equal(whole, alone)
