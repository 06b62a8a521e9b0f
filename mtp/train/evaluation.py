"""Evaluation of a trained model on texts it never saw: per-head loss and accuracy."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib
from mtp.model import mtp_model
from mtp.train import loss as loss_lib


@functools.partial(jax.jit, static_argnames=('graphdef', 'weights', 'chunk_size'))
def _metrics(graphdef, params, batch, weights, chunk_size):
  model = nnx.merge(graphdef, params)
  hidden = model(batch['tokens'], batch['positions'], batch['segment_ids'])
  return loss_lib.mtp_loss(hidden, model.unembedding(), batch['tokens'], batch['segment_ids'],
                           loss_scaling_factor=1.0, weights=list(weights),
                           chunk_size=chunk_size).metrics


def evaluate_texts(model: mtp_model.MTPModel, tokenizer: tokenizer_lib.Tokenizer,
                   texts: Sequence[str], seq_len: int, batch_size: int = 8,
                   max_batches: int = 16, chunk_size: int = 1024) -> dict[str, float]:
  """Token-weighted next-token and per-head loss/accuracy and the acceptance proxy on `texts`."""
  arrays = pipeline.pack(pipeline.tokenize_documents(texts, tokenizer), seq_len,
                         pad_id=tokenizer.pad_id)
  batch_size = min(batch_size, arrays['tokens'].shape[0])
  batches = pipeline.make_eval_batches(arrays, batch_size, max_batches, split='held-out')
  graphdef, params = nnx.split(model)
  weights = tuple(loss_lib.head_weights(model.mtp_num_heads, 1.0))
  totals: dict[str, float] = {}
  count = 0.0
  for batch in batches:
    metrics = jax.device_get(_metrics(graphdef, params, batch, weights, chunk_size))
    n = float(metrics.pop('num_tokens'))
    count += n
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + float(v) * n
  return {k: v / max(count, 1.0) for k, v in totals.items() if k not in ('loss', 'mtp_loss')}
