"""Joint multi-token loss: next-token loss + λ · Σ_k w_k · loss_k, memory-light.

The output layer dominates the cost of small models and its [tokens, vocab] logits dominate
their memory, so the hidden states of all heads are projected a chunk of tokens at a time under
`jax.checkpoint`: the backward pass recomputes each chunk's logits instead of keeping them, and
the full-vocabulary logits of all heads never exist at once.

Labels come from the tokens themselves: head k (0 = the trunk) at position t predicts token
t+1+k, counted only when that token lies in the same packed document (segment) as t.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

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


def chunked_cross_entropy(x: Array, unembedding: Array, labels: Array,
                          chunk_size: int) -> tuple[Array, Array]:
  """Per-token cross-entropy and argmax, projecting `chunk_size` tokens at a time.

  Args:
    x: [N, D] normalised hidden states.
    unembedding: [D, V] output matrix.
    labels: [N] int32 targets.
    chunk_size: tokens per chunk; only [chunk_size, V] logits are live at once, forward and
      backward.

  Returns:
    (loss [N] float32, predictions [N] int32: the argmax of each token's logits).
  """
  n, d = x.shape
  chunk_size = max(1, min(chunk_size, n))
  num_chunks = -(-n // chunk_size)
  padded = num_chunks * chunk_size
  x = jnp.pad(x, ((0, padded - n), (0, 0))).reshape(num_chunks, chunk_size, d)
  labels = jnp.pad(labels, (0, padded - n)).reshape(num_chunks, chunk_size)

  @jax.checkpoint
  def one_chunk(args):
    xc, yc = args
    logits = jnp.dot(xc, unembedding.astype(xc.dtype)).astype(jnp.float32)
    label_logit = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
    loss = jax.nn.logsumexp(logits, axis=-1) - label_logit
    return loss, jnp.argmax(logits, axis=-1).astype(jnp.int32)

  loss, predictions = jax.lax.map(one_chunk, (x, labels))
  return loss.reshape(-1)[:n], predictions.reshape(-1)[:n]


class LossOutput(NamedTuple):
  total: Array
  metrics: dict[str, Array]


def acceptance_proxy(predictions: Array, valid: Array) -> Array:
  """Mean number of head drafts greedy speculation would accept, under teacher forcing.

  Head k's draft at t (for token t+1+k) counts as accepted when it equals the trunk's own
  argmax at t+k (its prediction of that same token) and every earlier head's draft at t was
  accepted. The trunk sees the true prefix here rather than its own greedy chain, which is
  where the proxy and real decoding differ.

  Args:
    predictions: [K+1, B, T] argmax of the trunk (0) and heads.
    valid: [K+1, B, T] whether each head's label exists at t.

  Returns:
    Scalar: mean accepted drafts per position over positions where the next token is valid.
  """
  num_heads = predictions.shape[0] - 1
  t = predictions.shape[2]
  still_accepting = valid[0]
  accepted = jnp.zeros(predictions.shape[1:], jnp.float32)
  for k in range(1, num_heads + 1):
    trunk_later = jnp.pad(predictions[0][:, k:], ((0, 0), (0, min(k, t))), constant_values=-1)
    still_accepting = still_accepting & valid[k] & (predictions[k] == trunk_later)
    accepted = accepted + still_accepting
  count = jnp.maximum(jnp.sum(valid[0]), 1)
  return jnp.sum(accepted * valid[0]) / count


def mtp_loss(hidden: Array, unembedding: Array, tokens: Array, segment_ids: Array, *,
             loss_scaling_factor: float, weights: list[float], chunk_size: int) -> LossOutput:
  """The joint loss of the trunk and K heads.

  Args:
    hidden: [K+1, B, T, D] normalised hidden states: trunk, then heads 1..K.
    unembedding: [D, V] shared output matrix.
    tokens, segment_ids: [B, T] the packed batch.
    loss_scaling_factor: λ, the weight of the multi-token part.
    weights: K per-head weights w_k.
    chunk_size: tokens per cross-entropy chunk.

  Returns:
    LossOutput(total, metrics) with `ntp_loss`, `ntp_acc`, `head_k_loss`, `head_k_acc` for
    k = 1..K, `mtp_loss` (Σ_k w_k loss_k), `acceptance_proxy` and `num_tokens`.
  """
  num_outputs, b, t, d = hidden.shape
  labels, valid = zip(*(shifted_labels(tokens, segment_ids, 1 + k) for k in range(num_outputs)))
  labels, valid = jnp.stack(labels), jnp.stack(valid)
  loss, predictions = chunked_cross_entropy(hidden.reshape(-1, d), unembedding,
                                            labels.reshape(-1), chunk_size)
  loss = loss.reshape(num_outputs, b, t)
  predictions = predictions.reshape(num_outputs, b, t)
  counts = jnp.maximum(jnp.sum(valid, axis=(1, 2)), 1)
  per_head_loss = jnp.sum(loss * valid, axis=(1, 2)) / counts
  per_head_acc = jnp.sum((predictions == labels) & valid, axis=(1, 2)) / counts

  metrics = {'ntp_loss': per_head_loss[0], 'ntp_acc': per_head_acc[0],
             'num_tokens': jnp.sum(valid[0])}
  mtp_part = jnp.zeros((), jnp.float32)
  for k in range(1, num_outputs):
    metrics[f'head_{k}_loss'] = per_head_loss[k]
    metrics[f'head_{k}_acc'] = per_head_acc[k]
    mtp_part = mtp_part + weights[k - 1] * per_head_loss[k]
  total = per_head_loss[0] + loss_scaling_factor * mtp_part
  if num_outputs > 1:
    metrics['mtp_loss'] = mtp_part
    metrics['acceptance_proxy'] = acceptance_proxy(predictions, valid)
  metrics['loss'] = total
  return LossOutput(total=total, metrics=metrics)
