"""Evaluation of a trained model on texts it never saw: per-head loss and accuracy."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import draft_vocab
from mtp.model import mtp_model
from mtp.train import loss as loss_lib


@functools.partial(jax.jit, static_argnames=('graphdef', 'weights', 'chunk_size'))
def _metrics(graphdef, params, batch, weights, chunk_size, draft_ids=None):
  model = nnx.merge(graphdef, params)
  hidden = model(batch['tokens'], batch['positions'], batch['segment_ids'])
  return loss_lib.mtp_loss(hidden, model.unembedding(), batch['tokens'], batch['segment_ids'],
                           loss_scaling_factor=1.0, weights=list(weights),
                           chunk_size=chunk_size, draft_ids=draft_ids).metrics


def trained_draft_ids(loaded) -> np.ndarray | None:
  """[N] the draft vocabulary a loaded model's heads trained over (`mtp_head_draft_vocab`, the
  ids they also draft over), or None where they trained over the whole vocabulary."""
  size = loaded.config.get('mtp_head_draft_vocab')
  if not size or not loaded.model.mtp_num_heads:
    return None
  return draft_vocab.draft_vocabulary(loaded, int(size))


def evaluate_texts(model: mtp_model.MTPModel, tokenizer: tokenizer_lib.Tokenizer,
                   texts: Sequence[str], seq_len: int, batch_size: int = 8,
                   max_batches: int = 16, chunk_size: int = 1024,
                   draft_ids: np.ndarray | None = None) -> dict[str, float]:
  """Token-weighted next-token and per-head loss/accuracy and the acceptance proxy on `texts`.

  `draft_ids`: [N] the heads' draft vocabulary (`trained_draft_ids`): their logits over those
  ids only, as they train and draft (a label outside them counts as a miss); None: the whole
  vocabulary. (The demo's EAGLE-3 drafter over 8,192 of SmolLM2's 49,152 ids: its held-out
  evaluation took 33 s, not 51 s, and its accuracies are those of the drafts it makes.)
  """
  arrays = pipeline.pack(pipeline.tokenize_documents(texts, tokenizer), seq_len,
                         pad_id=tokenizer.pad_id)
  batch_size = min(batch_size, arrays['tokens'].shape[0])
  batches = pipeline.make_eval_batches(arrays, batch_size, max_batches, split='held-out')
  graphdef, params = nnx.split(model)
  weights = tuple(loss_lib.head_weights(model.mtp_num_heads, 1.0))
  if draft_ids is not None:
    draft_ids = jnp.asarray(draft_ids)  # Once, not per batch.
  totals: dict[str, float] = {}
  count = 0.0
  for batch in batches:
    metrics = jax.device_get(_metrics(graphdef, params, batch, weights, chunk_size, draft_ids))
    n = float(metrics.pop('num_tokens'))
    count += n
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + float(v) * n
  return {k: v / max(count, 1.0) for k, v in totals.items() if k not in ('loss', 'mtp_loss')}


@functools.partial(jax.jit, static_argnames=('graphdef',))
def _next_token_nll(graphdef, params, tokens, positions, segment_ids):
  """[B, T-1] negative log-likelihood of tokens[:, 1:] under the trunk."""
  model = nnx.merge(graphdef, params)
  logits = model.logits(model(tokens, positions, segment_ids)[0][:, :-1])
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]


def loss_by_position(model: mtp_model.MTPModel, tokenizer: tokenizer_lib.Tokenizer,
                     texts: Sequence[str], seq_len: int, edges: Sequence[int],
                     batch_size: int = 8, max_batches: int = 2) -> list[dict[str, float]]:
  """Next-token loss by position in the document: how well the model reads long contexts.

  A model trained on rows of L tokens has never attended over a distance beyond L; its loss at
  later positions says how far it still reads. Texts are packed into rows of `seq_len` as for
  training (a document longer than a row continues in the next row, from position 0).

  Args:
    edges: bucket boundaries of the predicting token's position, e.g. (0, 128, 256, 1024).

  Returns:
    One {'start', 'end', 'ntp_loss', 'tokens'} per bucket [edges[i], edges[i + 1]).
  """
  arrays = pipeline.pack(pipeline.tokenize_documents(texts, tokenizer), seq_len,
                         pad_id=tokenizer.pad_id)
  rows = min(arrays['tokens'].shape[0], batch_size * max_batches)
  graphdef, params = nnx.split(model)
  losses, positions, counted = [], [], []
  for start in range(0, rows, batch_size):
    batch = {k: jnp.asarray(v[start:min(start + batch_size, rows)]) for k, v in arrays.items()}
    nll = _next_token_nll(graphdef, params, batch['tokens'], batch['positions'],
                          batch['segment_ids'])
    segments = np.asarray(batch['segment_ids'])
    losses.append(np.asarray(nll))
    positions.append(np.asarray(batch['positions'])[:, :-1])
    counted.append((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0))
  losses, positions, counted = (np.concatenate(x) for x in (losses, positions, counted))
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    mask = counted & (positions >= lo) & (positions < hi)
    out.append({'start': int(lo), 'end': int(hi), 'tokens': int(mask.sum()),
                'ntp_loss': float(losses[mask].mean()) if mask.any() else float('nan')})
  return out
