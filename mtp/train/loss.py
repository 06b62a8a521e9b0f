"""Joint multi-token loss: next-token loss + λ · Σ_k w_k · loss_k, memory-light.

The output layer dominates the cost of small models and its [tokens, vocab] logits dominate
their memory. The hidden states of all heads go through one fused linear cross-entropy that
projects a chunk of tokens at a time and, when differentiated, computes the chunk's gradients
right away (a custom VJP): no logits are kept for the backward pass and none are recomputed, so
the full-vocabulary logits of all heads never exist at once and the output layer costs three
matrix products per token, as in an ordinary forward and backward pass.

Labels come from the tokens themselves: head k (0 = the trunk) at position t predicts token
t+1+k, counted only when that token lies in the same packed document (segment) as t. With soft
labels (EAGLE-3's, `distill.soft_labels`) a head learns instead the frozen trunk's whole
distribution over that token: the cross-entropy against softmax(trunk state at t+k @ output
layer), computed chunk by chunk in the same fused pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp.model import argmax as argmax_lib

Array = jax.Array


def head_weights(num_heads: int, decay: float) -> list[float]:
  """w_k = decay**k for heads k = 1..K (Medusa uses 0.8)."""
  return [decay ** k for k in range(1, num_heads + 1)]


def shifted_labels(tokens: Array, segment_ids: Array, shift: int) -> tuple[Array, Array]:
  """Labels token t+shift for each position t and whether it is valid.

  Args:
    tokens, segment_ids: [B, T]; segment id 0 marks padding.
    shift: 1 for the next token, 1+k for head k.

  Returns:
    (labels [B, T] int32, valid [B, T] bool): invalid past the row's end, across a document
    boundary or on padding.
  """
  t = tokens.shape[1]
  pad = min(shift, t)
  labels = jnp.pad(tokens[:, shift:], ((0, 0), (0, pad)))
  label_segments = jnp.pad(segment_ids[:, shift:], ((0, 0), (0, pad)))
  valid = (label_segments == segment_ids) & (segment_ids != 0)
  return labels.astype(jnp.int32), valid


def _chunks(x: Array, labels: Array, weights: Array, teacher: Array | None, chunk_size: int):
  """Pads N up to a multiple of chunk_size and reshapes to [num_chunks, chunk_size, ...]."""
  n = x.shape[0]
  num_chunks = -(-n // chunk_size)
  pad = num_chunks * chunk_size - n

  def rows(a):
    return jnp.pad(a, ((0, pad), (0, 0))).reshape(num_chunks, chunk_size, -1)

  return (rows(x), jnp.pad(labels, (0, pad)).reshape(num_chunks, chunk_size),
          jnp.pad(weights, (0, pad)).reshape(num_chunks, chunk_size),
          None if teacher is None else rows(teacher))


def _chunk_logits(xc: Array, unembedding: Array, yc: Array, tc: Array | None):
  """A chunk's logits [C, V], logsumexp [C], loss [C], argmax [C] and its target distribution
  [C, V]: the teacher's softmax, or None (the labels' one-hot)."""
  # bfloat16 activations: float32 accumulation, float32 logits and loss.
  logits = jnp.dot(xc, unembedding.astype(xc.dtype), preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  if tc is None:
    loss = lse - jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
    target = None
  else:
    target = jax.nn.softmax(jnp.dot(tc, unembedding.astype(tc.dtype),
                                    preferred_element_type=jnp.float32), axis=-1)
    loss = lse - jnp.sum(target * logits, axis=-1)
  return logits, lse, loss, argmax_lib.argmax(logits), target


def _fused_forward(x, unembedding, labels, weights, teacher, chunk_size):
  n = x.shape[0]

  def body(_, chunk):
    xc, yc, _, tc = chunk
    _, _, loss, predictions, _ = _chunk_logits(xc, unembedding, yc, tc)
    return None, (loss, predictions)

  _, (loss, predictions) = jax.lax.scan(
      body, None, _chunks(x, labels, weights, teacher, chunk_size))
  loss, predictions = loss.reshape(-1)[:n], predictions.reshape(-1)[:n]
  return jnp.sum(loss * weights), loss, predictions


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused(x, unembedding, labels, weights, teacher, chunk_size, train_unembedding):
  del train_unembedding
  return _fused_forward(x, unembedding, labels, weights, teacher, chunk_size)


def _fused_fwd(x, unembedding, labels, weights, teacher, chunk_size, train_unembedding):
  n, d = x.shape
  vocab = unembedding.shape[1]

  def body(grad_w, chunk):
    xc, yc, wc, tc = chunk
    logits, lse, loss, predictions, target = _chunk_logits(xc, unembedding, yc, tc)
    if target is None:
      target = jax.nn.one_hot(yc, vocab)
    # d(sum_i w_i * loss_i) / d logits = w_i * (softmax - target).
    dlogits = (jnp.exp(logits - lse[:, None]) - target) * wc[:, None]
    # Float32 sums of the activations' type (bfloat16: XLA:CPU's fast kernel; a bfloat16
    # result or a float32 operand beside a bfloat16 one runs at about half its speed).
    dlogits = dlogits.astype(xc.dtype)
    grad_x = jnp.dot(dlogits, unembedding.astype(xc.dtype).T,
                     preferred_element_type=jnp.float32).astype(xc.dtype)
    if train_unembedding:  # A frozen output layer skips a third of the matmuls.
      grad_w = grad_w + jnp.dot(xc.T, dlogits, preferred_element_type=jnp.float32)
    return grad_w, (loss, predictions, grad_x)

  grad_w, (loss, predictions, grad_x) = jax.lax.scan(
      body, jnp.zeros((d, vocab) if train_unembedding else (), jnp.float32),
      _chunks(x, labels, weights, teacher, chunk_size))
  if not train_unembedding:
    grad_w = jnp.zeros((d, vocab), jnp.float32)
  loss, predictions = loss.reshape(-1)[:n], predictions.reshape(-1)[:n]
  grad_x = grad_x.reshape(-1, d)[:n]
  out = (jnp.sum(loss * weights), loss, predictions)
  return out, (grad_x, grad_w.astype(unembedding.dtype), loss, labels, teacher)


def _fused_bwd(chunk_size, train_unembedding, residuals, cotangents):
  del chunk_size, train_unembedding
  grad_x, grad_w, loss, labels, teacher = residuals
  g = cotangents[0]  # Only the weighted sum is differentiable; see fused_cross_entropy.
  label_cotangent = np.zeros(labels.shape, jax.dtypes.float0)
  # The teacher is a target: no gradient flows into it.
  teacher_cotangent = None if teacher is None else jnp.zeros_like(teacher)
  # Each cotangent in its primal's dtype (bfloat16 activations stay bfloat16).
  return ((g * grad_x).astype(grad_x.dtype), g * grad_w, label_cotangent, g * loss,
          teacher_cotangent)


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_cross_entropy(x: Array, unembedding: Array, labels: Array, weights: Array,
                        chunk_size: int, train_unembedding: bool = True,
                        teacher: Array | None = None) -> tuple[Array, Array, Array]:
  """Weighted cross-entropy of x @ unembedding against labels, `chunk_size` tokens at a time.

  Args:
    x: [N, D] normalised hidden states.
    unembedding: [D, V] output matrix.
    labels: [N] int32 targets (with `teacher`, only what `predictions` are compared with).
    weights: [N] per-token weights (0 for tokens that do not count).
    chunk_size: tokens per chunk: only [chunk_size, V] logits are live at once. 0 projects
      all tokens at once and lets autodiff keep the logits (the naive baseline, for
      comparisons).
    train_unembedding: False when the output matrix is frozen: its gradient is zero and is
      not computed.
    teacher: [N, D] normalised states whose distributions softmax(teacher @ unembedding) are
      the targets (soft labels), in place of `labels`; they get no gradient. The loss is then
      the cross-entropy against them (KL divergence plus the teacher's entropy).

  Returns:
    (sum_i weights_i * loss_i, differentiable; loss [N] float32 and predictions [N] int32,
    the argmax of each token's logits, both without gradient).
  """
  if teacher is not None:
    teacher = jax.lax.stop_gradient(teacher)
  if chunk_size <= 0:
    logits = jnp.dot(x, unembedding.astype(x.dtype), preferred_element_type=jnp.float32)
    if teacher is None:
      target = jax.nn.one_hot(labels, logits.shape[-1])
    else:
      target = jax.lax.stop_gradient(jax.nn.softmax(jnp.dot(
          teacher, unembedding.astype(teacher.dtype), preferred_element_type=jnp.float32),
                                                   axis=-1))
    loss = jax.nn.logsumexp(logits, -1) - jnp.sum(target * logits, axis=-1)
    return (jnp.sum(loss * weights), jax.lax.stop_gradient(loss),
            argmax_lib.argmax(logits))
  total, loss, predictions = _fused(x, unembedding, labels, weights, teacher,
                                    min(chunk_size, x.shape[0]), train_unembedding)
  return total, jax.lax.stop_gradient(loss), predictions


class LossOutput(NamedTuple):
  total: Array
  metrics: dict[str, Array]


def head_positions(seq_len: int, stride: int, offset) -> Array:
  """Positions where the heads' losses count: offset, offset + stride, ... [seq_len // stride].

  With stride 1 that is every position. A larger stride divides the heads' output-layer cost
  (four full-vocabulary projections for four heads) by `stride`; rotating `offset` with the step
  still covers every position over `stride` steps.
  """
  return offset % stride + stride * jnp.arange(seq_len // stride)


def acceptance_proxy(trunk_predictions: Array, head_predictions: Array, positions: Array,
                     trunk_valid: Array, head_valid: Array) -> Array:
  """Mean number of head drafts greedy speculation would accept, under teacher forcing.

  Head k's draft at t (for token t+1+k) counts as accepted when it equals the trunk's own
  argmax at t+k (its prediction of that same token) and every earlier head's draft at t was
  accepted. The trunk sees the true prefix here rather than its own greedy chain, which is
  where the proxy and real decoding differ.

  Args:
    trunk_predictions: [B, T] the trunk's argmax at every position.
    head_predictions: [K, B, P] heads' argmax at `positions` [P].
    trunk_valid: [B, T] whether the next token exists at t.
    head_valid: [K, B, P] whether head k's label exists at each of `positions`.

  Returns:
    Scalar: mean accepted drafts per position over `positions` where the next token is valid.
  """
  t = trunk_predictions.shape[1]
  valid_here = trunk_valid[:, positions]
  still_accepting = valid_here
  accepted = jnp.zeros(valid_here.shape, jnp.float32)
  for k in range(1, head_predictions.shape[0] + 1):
    trunk_later = trunk_predictions[:, jnp.minimum(positions + k, t - 1)]
    still_accepting = still_accepting & head_valid[k - 1] & (head_predictions[k - 1] ==
                                                             trunk_later)
    accepted = accepted + still_accepting
  return jnp.sum(accepted * valid_here) / jnp.maximum(jnp.sum(valid_here), 1)


def smooth_l1(x: Array) -> Array:
  """Elementwise smooth L1 (Huber, delta 1): 0.5 x^2 where |x| < 1, else |x| - 0.5."""
  magnitude = jnp.abs(x)
  return jnp.where(magnitude < 1.0, 0.5 * jnp.square(x), magnitude - 0.5)


def feature_regression(hidden: Array, segment_ids: Array,
                       head_mask: Array | None = None) -> Array:
  """EAGLE's feature loss: head k's output at t against the trunk's normalised state at t+k.

  The trunk's states are targets only (no gradient flows into them).

  Args:
    hidden: [K+1, B, T, D] as `mtp_loss` reads it: entry 0 the trunk's normalised state, entry
      k head k's output (a prediction of entry 0 at t+k).
    segment_ids: [B, T]; a target in another document (or padding) does not count.
    head_mask: [B, T] bool, where the heads' losses may count (None: everywhere).

  Returns:
    [K] float32: per head, smooth L1 averaged over the width and the valid positions.
  """
  target = jax.lax.stop_gradient(hidden[0]).astype(jnp.float32)
  losses = []
  for k in range(1, hidden.shape[0]):
    _, valid = shifted_labels(segment_ids, segment_ids, k)
    if head_mask is not None:
      valid = valid & head_mask
    t = target.shape[1]
    shifted = jnp.pad(target[:, k:], ((0, 0), (0, min(k, t)), (0, 0)))[:, :t]
    per_token = jnp.mean(smooth_l1(hidden[k].astype(jnp.float32) - shifted), axis=-1)
    losses.append(jnp.sum(per_token * valid) / jnp.maximum(jnp.sum(valid), 1))
  return jnp.stack(losses)


def mtp_loss(hidden: Array, unembedding: Array, tokens: Array, segment_ids: Array, *,
             loss_scaling_factor: float, weights: list[float], chunk_size: int,
             positions: Array | None = None, head_mask: Array | None = None,
             trunk_is_teacher: bool = False, train_unembedding: bool = True,
             feature_loss_weight: float = 0.0, soft_labels: bool = False,
             draft_ids: Array | None = None) -> LossOutput:
  """The joint loss of the trunk and K heads.

  Args:
    hidden: [K+1, B, T, D] normalised hidden states: trunk, then heads 1..K.
    unembedding: [D, V] shared output matrix.
    tokens, segment_ids: [B, T] the packed batch.
    loss_scaling_factor: λ, the weight of the multi-token part.
    weights: K per-head weights w_k.
    chunk_size: tokens per cross-entropy chunk.
    positions: [P] positions where the heads' losses count (`head_positions`); all if None.
      The next-token loss always counts every position.
    head_mask: [B, T] bool, where the heads' losses may count at all (None: everywhere); e.g.
      only on a greedy continuation, not on the prompt it continues.
    trunk_is_teacher: the labels are the (frozen) trunk's own greedy tokens, so its loss is
      constant: skip its output layer (no `ntp_*` metrics) and read its predictions from the
      labels for the acceptance proxy.
    train_unembedding: False when the output matrix is frozen (with the trunk).
    feature_loss_weight: β: adds β · Σ_k w_k · `feature_regression`_k (EAGLE's feature loss;
      0 for families whose outputs are not predicted features).
    soft_labels: head k at t learns the trunk's distribution at t+k (softmax of hidden[0]
      there through the output layer, a frozen trunk being the teacher) instead of the label
      token; `head_k_loss` is then that cross-entropy, `head_k_acc` still compares with the
      labels. The trunk's own loss (without trunk_is_teacher) keeps its labels.
    draft_ids: [N] distinct token ids, the heads' draft vocabulary (EAGLE-3's d2t, FR-Spec's
      frequent ids), or None for the whole vocabulary. The heads' logits (and soft labels'
      targets) are those N columns of the output layer only; a head's loss skips positions
      whose label is not among them (it could never draft it), while `head_k_acc` and the
      acceptance proxy still count them, as misses.

  Returns:
    LossOutput(total, metrics) with `ntp_loss`, `ntp_acc`, `head_k_loss`, `head_k_acc` for
    k = 1..K, `mtp_loss` (Σ_k w_k loss_k), `acceptance_proxy` and `num_tokens`; with a
    feature loss also `head_k_feature_loss` and `feature_loss` (Σ_k w_k feature_loss_k).
  """
  num_outputs, b, t, d = hidden.shape
  num_heads = num_outputs - 1
  if trunk_is_teacher and not num_heads:
    raise ValueError('trunk_is_teacher leaves nothing to train without heads')
  if positions is None:
    positions = jnp.arange(t)
  labels, valid = zip(*(shifted_labels(tokens, segment_ids, 1 + k) for k in range(num_outputs)))
  # Trunk: every position. Heads: only `positions`.
  labels = [labels[0]] + [l[:, positions] for l in labels[1:]]
  if head_mask is not None:
    valid = valid[:1] + tuple(v & head_mask for v in valid[1:])
  valid = [valid[0]] + [v[:, positions] for v in valid[1:]]
  x = [hidden[0].reshape(-1, d)] + [h[:, positions].reshape(-1, d) for h in hidden[1:]]
  head_unembedding, loss_labels, loss_valid = unembedding, list(labels), list(valid)
  if draft_ids is not None and num_heads:
    head_unembedding = jnp.take(unembedding, draft_ids, axis=1)
    to_draft = jnp.full((unembedding.shape[1],), -1, jnp.int32).at[draft_ids].set(
        jnp.arange(draft_ids.shape[0], dtype=jnp.int32))
    in_draft = [to_draft[l] for l in labels[1:]]
    loss_labels[1:] = [jnp.maximum(i, 0) for i in in_draft]
    loss_valid[1:] = [v & (i >= 0) for v, i in zip(valid[1:], in_draft)]
  counts = [jnp.maximum(jnp.sum(v), 1) for v in valid]
  loss_counts = [jnp.maximum(jnp.sum(v), 1) for v in loss_valid]
  coefficients = [1.0] + [loss_scaling_factor * w for w in weights[:num_heads]]
  token_weights = [v.reshape(-1) * (c / n)
                   for v, c, n in zip(loss_valid, coefficients, loss_counts)]
  first = 1 if trunk_is_teacher else 0  # Outputs that go through the output layer.
  flat_labels = [l.reshape(-1) for l in loss_labels]
  if num_heads and (soft_labels or draft_ids is not None):  # The heads read their own matrix.
    teacher = None
    if soft_labels:
      # Head k's target at t is the trunk's distribution at t+k, which picks token t+1+k.
      teacher = jnp.concatenate([
          jnp.pad(hidden[0][:, k:], ((0, 0), (0, min(k, t)), (0, 0)))[:, :t][:, positions]
          .reshape(-1, d) for k in range(1, num_outputs)])
    total, loss, predictions = fused_cross_entropy(
        jnp.concatenate(x[1:]), head_unembedding, jnp.concatenate(flat_labels[1:]),
        jnp.concatenate(token_weights[1:]), chunk_size, train_unembedding, teacher=teacher)
    if draft_ids is not None:
      predictions = jnp.take(draft_ids, predictions)
    if not first:  # The trunk's own next-token loss, on its labels.
      trunk_total, trunk_loss, trunk_predictions = fused_cross_entropy(
          x[0], unembedding, flat_labels[0], token_weights[0], chunk_size, train_unembedding)
      total = total + trunk_total
      loss = jnp.concatenate([trunk_loss, loss])
      predictions = jnp.concatenate([trunk_predictions, predictions])
  else:
    total, loss, predictions = fused_cross_entropy(
        jnp.concatenate(x[first:]), unembedding, jnp.concatenate(flat_labels[first:]),
        jnp.concatenate(token_weights[first:]), chunk_size, train_unembedding)
  sizes = np.cumsum([b * t] * (1 - first) + [b * positions.shape[0]] * num_heads)[:-1]
  loss = [part.reshape(v.shape) for part, v in zip(jnp.split(loss, sizes), valid[first:])]
  predictions = [part.reshape(v.shape)
                 for part, v in zip(jnp.split(predictions, sizes), valid[first:])]
  if trunk_is_teacher:
    loss, predictions = [None] + loss, [labels[0]] + predictions

  metrics = {'num_tokens': jnp.sum(valid[0])}
  mtp_part = jnp.zeros((), jnp.float32)
  for k in range(first, num_outputs):
    head_loss = jnp.sum(loss[k] * loss_valid[k]) / loss_counts[k]
    head_acc = jnp.sum((predictions[k] == labels[k]) & valid[k]) / counts[k]
    name = 'ntp' if k == 0 else f'head_{k}'
    metrics[f'{name}_loss'], metrics[f'{name}_acc'] = head_loss, head_acc
    if k:
      mtp_part = mtp_part + weights[k - 1] * head_loss
  if num_heads:
    metrics['mtp_loss'] = mtp_part
    metrics['acceptance_proxy'] = acceptance_proxy(
        predictions[0], jnp.stack(predictions[1:]), positions, valid[0], jnp.stack(valid[1:]))
  if num_heads and feature_loss_weight:
    features = feature_regression(hidden, segment_ids, head_mask)
    feature_part = jnp.zeros((), jnp.float32)
    for k in range(1, num_outputs):
      metrics[f'head_{k}_feature_loss'] = features[k - 1]
      feature_part = feature_part + weights[k - 1] * features[k - 1]
    metrics['feature_loss'] = feature_part
    total = total + feature_loss_weight * feature_part
  metrics['loss'] = total
  return LossOutput(total=total, metrics=metrics)
