"""The joint loss equals a direct computation; labels respect document boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtp.train import loss as loss_lib


def _direct(hidden, w, tokens, segments, lam, weights, head_mask=None):
  """Full logits for every head at once, optax cross-entropy, explicit loops over positions."""
  k1, b, t, _ = hidden.shape
  logits = np.asarray(jnp.einsum('kbtd,dv->kbtv', hidden, w))
  losses, accs = [], []
  for k in range(k1):
    num, correct, count = 0.0, 0, 0
    for i in range(b):
      for j in range(t):
        target = j + 1 + k
        if target >= t or segments[i, j] == 0 or segments[i, target] != segments[i, j]:
          continue
        if k and head_mask is not None and not head_mask[i, j]:
          continue
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[k, i, j], tokens[i, target])
        num += float(ce)
        correct += int(np.argmax(logits[k, i, j]) == tokens[i, target])
        count += 1
    losses.append(num / count)
    accs.append(correct / count)
  total = losses[0] + lam * sum(wk * lk for wk, lk in zip(weights, losses[1:]))
  return total, losses, accs


@pytest.mark.parametrize('segments, head_mask', [
    ([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 0, 0]], None),
    # A prompt's positions (mask False) count for the trunk, not for the heads.
    ([[1] * 9, [1] * 9], [[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1]]),
], ids=['packed_documents', 'head_mask'])
def test_loss_equals_direct_computation(segments, head_mask):
  rng = np.random.default_rng(0)
  k1, b, t, d, v = 4, 2, 9, 8, 13
  hidden = jnp.asarray(rng.normal(size=(k1, b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  segments = np.array(segments, np.int32)
  mask = None if head_mask is None else np.array(head_mask, bool)
  weights = loss_lib.head_weights(3, 0.8)

  def loss(mask):
    return loss_lib.mtp_loss(hidden, w, jnp.asarray(tokens), jnp.asarray(segments),
                             loss_scaling_factor=0.5, weights=weights, chunk_size=5,
                             head_mask=None if mask is None else jnp.asarray(mask))

  out = loss(mask)
  total, losses, accs = _direct(hidden, w, tokens, segments, 0.5, weights, mask)
  np.testing.assert_allclose(out.total, total, rtol=1e-5)
  for k in (0, 1, 2, 3):
    name = 'ntp' if k == 0 else f'head_{k}'
    np.testing.assert_allclose(out.metrics[f'{name}_loss'], losses[k], rtol=1e-5)
    np.testing.assert_allclose(out.metrics[f'{name}_acc'], accs[k], rtol=1e-6)
  if mask is not None:
    assert not np.isclose(loss(None).metrics['head_1_loss'], out.metrics['head_1_loss'])


@pytest.mark.parametrize('chunk_size', [4, 11, 0])
def test_fused_cross_entropy_value_and_gradients_match_optax(chunk_size):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 17)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 17, 11), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=11) * (rng.uniform(size=11) > 0.3), jnp.float32)

  def fused(x, w, weights):
    return loss_lib.fused_cross_entropy(x, w, y, weights, chunk_size)[0]

  def reference(x, w, weights):
    return jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(x @ w, y))

  np.testing.assert_allclose(fused(x, w, weights), reference(x, w, weights), rtol=1e-5)
  for a, b in zip(jax.grad(fused, (0, 1, 2))(x, w, weights),
                  jax.grad(reference, (0, 1, 2))(x, w, weights)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  _, loss, predictions = loss_lib.fused_cross_entropy(x, w, y, weights, chunk_size)
  np.testing.assert_allclose(loss, optax.softmax_cross_entropy_with_integer_labels(x @ w, y),
                             rtol=1e-5)
  np.testing.assert_array_equal(predictions, jnp.argmax(x @ w, -1))


def test_joint_loss_gradient_matches_direct_autodiff():
  rng = np.random.default_rng(2)
  hidden = jnp.asarray(rng.normal(size=(3, 2, 7, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 9)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 9, (2, 7)), jnp.int32)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1] * 7])

  def fused(hidden, w):
    return loss_lib.mtp_loss(hidden, w, tokens, segments, loss_scaling_factor=0.3,
                             weights=[0.8, 0.64], chunk_size=4).total

  def naive(hidden, w):
    return loss_lib.mtp_loss(hidden, w, tokens, segments, loss_scaling_factor=0.3,
                             weights=[0.8, 0.64], chunk_size=0).total

  np.testing.assert_allclose(fused(hidden, w), naive(hidden, w), rtol=1e-5)
  for a, b in zip(jax.grad(fused, (0, 1))(hidden, w), jax.grad(naive, (0, 1))(hidden, w)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_shifted_labels_stop_at_document_boundaries_and_padding():
  tokens = jnp.array([[5, 6, 7, 8, 9]])
  segments = jnp.array([[1, 1, 2, 2, 0]])
  labels, valid = loss_lib.shifted_labels(tokens, segments, 1)
  np.testing.assert_array_equal(labels, [[6, 7, 8, 9, 0]])
  np.testing.assert_array_equal(valid, [[True, False, True, False, False]])


def test_acceptance_proxy_counts_prefixes_that_agree_with_the_trunk():
  # Trunk argmax per position; head 1 at t should equal trunk at t+1, head 2 trunk at t+2.
  trunk = np.array([[10, 11, 12, 13, 14, 15]])
  head1 = np.array([[11, 12, 0, 14, 15, 0]])   # agrees at t = 0, 1, 3, 4
  head2 = np.array([[12, 0, 0, 15, 0, 0]])     # agrees at t = 0, 3
  heads = jnp.asarray(np.stack([head1, head2]))
  valid = jnp.ones((1, 6), bool)
  # Accepted prefix lengths: t0: 2, t1: 1, t2: 0, t3: 2, t4: 1, t5: 0 (head 1 wants t6).
  got = loss_lib.acceptance_proxy(jnp.asarray(trunk), heads, jnp.arange(6), valid,
                                  jnp.ones((2, 1, 6), bool))
  np.testing.assert_allclose(got, 6 / 6)


def test_oracle_heads_have_full_acceptance():
  trunk = np.arange(20).reshape(1, 20)
  heads = [np.concatenate([trunk[:, k:], -np.ones((1, k), int)], 1) for k in (1, 2, 3)]
  valid = jnp.ones((4, 1, 20), bool)
  for k in range(4):  # head k's label t+1+k exists for t < 19 - k
    valid = valid.at[k, :, 19 - k:].set(False)
  got = loss_lib.acceptance_proxy(jnp.asarray(trunk), jnp.asarray(np.stack(heads)),
                                  jnp.arange(20), valid[0], valid[1:])
  # Every position accepts as many heads as have labels there: min(3, 18 - t) for t < 19.
  expected = sum(min(3, max(0, 19 - 1 - t)) for t in range(19)) / 19
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_strided_head_positions_equal_the_loss_on_those_positions():
  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.normal(size=(3, 2, 8, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 11)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 11, (2, 8)), jnp.int32)
  segments = jnp.ones((2, 8), jnp.int32)
  positions = loss_lib.head_positions(8, 4, offset=5)
  np.testing.assert_array_equal(positions, [1, 5])
  out = loss_lib.mtp_loss(hidden, w, tokens, segments, loss_scaling_factor=1.0,
                          weights=[1.0, 1.0], chunk_size=3, positions=positions)
  full = loss_lib.mtp_loss(hidden, w, tokens, segments, loss_scaling_factor=1.0,
                           weights=[1.0, 1.0], chunk_size=3)
  np.testing.assert_allclose(out.metrics['ntp_loss'], full.metrics['ntp_loss'], rtol=1e-6)
  logits = np.asarray(jnp.einsum('kbtd,dv->kbtv', hidden, w))
  for k in (1, 2):
    ces = [float(optax.softmax_cross_entropy_with_integer_labels(
        logits[k, i, p], tokens[i, p + 1 + k])) for i in range(2) for p in (1, 5) if p + 1 + k < 8]
    np.testing.assert_allclose(out.metrics[f'head_{k}_loss'], np.mean(ces), rtol=1e-5)


def test_a_teacher_trunk_skips_its_own_loss_and_nothing_else():
  """Labels = the trunk's greedy tokens: heads' losses, gradients and the proxy are unchanged."""
  rng = np.random.default_rng(4)
  hidden = jnp.asarray(rng.normal(size=(3, 2, 9, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 11)), jnp.float32)
  greedy = np.argmax(np.asarray(hidden[0] @ w), axis=-1)
  labels = jnp.asarray(np.concatenate([greedy[:, :1], greedy[:, :-1]], 1), jnp.int32)
  segments = jnp.asarray([[1] * 9, [1] * 5 + [2] * 4], jnp.int32)

  def run(h, trunk_is_teacher):
    return loss_lib.mtp_loss(h, w, labels, segments, loss_scaling_factor=0.5,
                             weights=[0.8, 0.64], chunk_size=4,
                             trunk_is_teacher=trunk_is_teacher)

  full, skipped = run(hidden, False), run(hidden, True)
  assert full.metrics['ntp_acc'] == 1.0 and 'ntp_loss' not in skipped.metrics
  for key in ('head_1_loss', 'head_2_acc', 'mtp_loss', 'acceptance_proxy'):
    np.testing.assert_allclose(skipped.metrics[key], full.metrics[key], rtol=1e-6)
  np.testing.assert_allclose(skipped.total, full.total - full.metrics['ntp_loss'], rtol=1e-6)
  head_grad = lambda t: jax.grad(lambda h: run(h, t).total)(hidden)[1:]
  np.testing.assert_allclose(head_grad(True), head_grad(False), rtol=1e-5, atol=1e-7)


def test_a_frozen_output_layer_gets_no_gradient_and_the_same_input_gradient():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(10, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 13)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 13, 10), jnp.int32)
  weights = jnp.asarray(rng.random(10), jnp.float32)
  grads = lambda train: jax.grad(lambda x, w: loss_lib.fused_cross_entropy(
      x, w, labels, weights, 4, train_unembedding=train)[0], argnums=(0, 1))(x, w)
  (gx, gw), (gx_frozen, gw_frozen) = grads(True), grads(False)
  np.testing.assert_allclose(gx_frozen, gx, rtol=1e-6)
  assert np.abs(gw).max() > 0 and not np.any(gw_frozen)


@pytest.mark.parametrize('chunk_size', [4, 11, 0])
@pytest.mark.parametrize('train_unembedding', [True, False])
def test_soft_labels_value_and_gradients_match_optax(chunk_size, train_unembedding):
  """Cross-entropy against softmax(teacher @ w); the teacher is a target, never trained."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)
  teacher = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 17)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 17, 11), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=11) * (rng.uniform(size=11) > 0.3), jnp.float32)

  def fused(x, w, teacher):
    return loss_lib.fused_cross_entropy(x, w, y, weights, chunk_size, train_unembedding,
                                        teacher=teacher)[0]

  frozen = chunk_size > 0 and not train_unembedding  # The naive path trains it regardless.

  def reference(x, w, teacher):
    if frozen:
      w = jax.lax.stop_gradient(w)
    target = jax.nn.softmax(jax.lax.stop_gradient(teacher @ w))
    return jnp.sum(weights * optax.softmax_cross_entropy(x @ w, target))

  np.testing.assert_allclose(fused(x, w, teacher), reference(x, w, teacher), rtol=1e-5)
  grads = jax.grad(fused, (0, 1, 2))(x, w, teacher)
  for a, b in zip(grads, jax.grad(reference, (0, 1, 2))(x, w, teacher)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert not np.any(grads[2]) and bool(np.any(grads[1])) != frozen
  # Labels are not the target any more; they only score the predictions.
  other = loss_lib.fused_cross_entropy(x, w, (y + 1) % 17, weights, chunk_size, teacher=teacher)
  np.testing.assert_allclose(other[0], fused(x, w, teacher), rtol=1e-6)


def test_soft_labels_teach_each_head_the_trunks_distribution_at_its_token():
  """Head k at t learns softmax(trunk state at t+k); a sharp trunk gives the hard-label loss."""
  rng = np.random.default_rng(7)
  k1, b, t, d, v = 3, 2, 8, 5, 11
  hidden = jnp.asarray(rng.normal(size=(k1, b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  segments = jnp.asarray([[1] * 8, [1] * 5 + [2] * 3], jnp.int32)
  greedy = np.argmax(np.asarray(hidden[0] @ w), axis=-1)
  labels = jnp.asarray(np.concatenate([greedy[:, :1], greedy[:, :-1]], 1), jnp.int32)

  def run(h, soft, positions=None):
    return loss_lib.mtp_loss(h, w, labels, segments, loss_scaling_factor=0.5,
                             weights=[0.8, 0.64], chunk_size=4, trunk_is_teacher=True,
                             soft_labels=soft, positions=positions)

  out = run(hidden, True)
  probs = np.asarray(jax.nn.softmax(hidden[0] @ w))
  logp = np.asarray(jax.nn.log_softmax(hidden @ w))
  for k in (1, 2):
    ces = [-np.sum(probs[i, j + k] * logp[k, i, j]) for i in range(b) for j in range(t)
           if j + 1 + k < t and segments[i, j + 1 + k] == segments[i, j]]
    np.testing.assert_allclose(out.metrics[f'head_{k}_loss'], np.mean(ces), rtol=1e-5)
  hard = run(hidden, False)
  np.testing.assert_allclose(out.metrics['head_2_acc'], hard.metrics['head_2_acc'])
  assert out.metrics['head_1_loss'] < hard.metrics['head_1_loss']  # Not the labels' loss.
  # Strided positions read the same targets.
  positions = jnp.array([1, 3, 5])
  np.testing.assert_allclose(run(hidden, True, positions).metrics['head_1_loss'],
                             np.mean([-np.sum(probs[i, j + 1] * logp[1, i, j])
                                      for i in range(b) for j in (1, 3, 5)
                                      if segments[i, j + 2] == segments[i, j]]), rtol=1e-5)
  sharp = hidden.at[0].multiply(200.0)
  np.testing.assert_allclose(run(sharp, True).total, run(sharp, False).total, rtol=1e-4)
  # The trunk's own loss, when it is not the teacher, keeps its labels.
  own = loss_lib.mtp_loss(hidden, w, labels, segments, loss_scaling_factor=0.5,
                          weights=[0.8, 0.64], chunk_size=4, soft_labels=True)
  hard_own = loss_lib.mtp_loss(hidden, w, labels, segments, loss_scaling_factor=0.5,
                               weights=[0.8, 0.64], chunk_size=4)
  np.testing.assert_allclose(own.metrics['ntp_loss'], hard_own.metrics['ntp_loss'], rtol=1e-6)
  np.testing.assert_allclose(own.total - own.metrics['ntp_loss'], out.total, rtol=1e-5)


@pytest.mark.parametrize('soft', [False, True])
def test_a_draft_vocabulary_restricts_the_heads_logits_and_skips_labels_outside_it(soft):
  rng = np.random.default_rng(8)
  k1, b, t, d, v = 3, 2, 8, 5, 11
  hidden = jnp.asarray(rng.normal(size=(k1, b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  segments = jnp.asarray([[1] * 8, [1] * 5 + [2] * 3], jnp.int32)
  ids = np.array([7, 2, 9, 0, 4, 5], np.int32)

  def run(draft_ids):
    return loss_lib.mtp_loss(hidden, w, tokens, segments, loss_scaling_factor=0.5,
                             weights=[0.8, 0.64], chunk_size=4, soft_labels=soft,
                             draft_ids=None if draft_ids is None else jnp.asarray(draft_ids))

  out, full = run(ids), run(None)
  np.testing.assert_allclose(out.metrics['ntp_loss'], full.metrics['ntp_loss'], rtol=1e-6)
  # Every id, in any order, is the whole vocabulary.
  np.testing.assert_allclose(run(rng.permutation(v)).total, full.total, rtol=1e-5)
  logits = np.asarray(hidden @ w)
  tok = np.asarray(tokens)
  for k in (1, 2):
    ces, hits, count = [], 0, 0
    for i in range(b):
      for j in range(t):
        if j + 1 + k >= t or segments[i, j + 1 + k] != segments[i, j]:
          continue
        label = tok[i, j + 1 + k]
        count += 1
        drafted = ids[np.argmax(logits[k, i, j, ids])]
        hits += int(drafted == label)
        if label not in ids:
          continue  # Never drafted: no loss, a miss.
        logp = jax.nn.log_softmax(logits[k, i, j, ids])
        target = (jax.nn.softmax(logits[0, i, j + k, ids]) if soft else
                  np.eye(len(ids))[list(ids).index(label)])
        ces.append(-float(np.sum(target * logp)))
    np.testing.assert_allclose(out.metrics[f'head_{k}_loss'], np.mean(ces), rtol=1e-5)
    np.testing.assert_allclose(out.metrics[f'head_{k}_acc'], hits / count, rtol=1e-6)
