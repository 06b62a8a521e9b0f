"""Forward FLOPs of the model's parts: the counting rules a head family reuses for its own count.

Pure arithmetic on shapes, here under `mtp.model` so that each head family counts its heads in
its own module (`HeadFamily.train_flops`) without importing the training code: `mtp.train.flops`
adds the trunk, the output layer and the backward passes (and documents the conventions: a
multiply-add is 2 FLOPs; elementwise work is not counted).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from mtp.model import transformer

# 'causal': the T(T+1)/2 query-key pairs causal attention needs (model FLOPs); 'full': the
# T x T square the program computes and masks.
AttentionCount = Literal['causal', 'full']


class UnknownHeadFamily(ValueError):
  """A head family without a FLOP count (it does not implement `HeadFamily.train_flops`)."""


class HeadFlops(NamedTuple):
  """Forward FLOPs of a head family's training pass over B rows of T tokens.

  Attributes:
    matmul: the heads' own matrix products (projections, MLPs, ResBlocks).
    attention: the heads' attention scores and values.
    remat_recompute: the part of the two above that `model.remat` recomputes in the backward
      pass (every remat policy recomputes the heads' transformer layers whole).
  """
  matmul: float
  attention: float
  remat_recompute: float


def block_matmul_flops(cfg: transformer.TransformerConfig, tokens: int) -> float:
  """Forward FLOPs of one transformer layer's projections and MLP over `tokens` tokens."""
  d, hd = cfg.embed_dim, cfg.head_dim
  q_width, kv_width = cfg.num_attention_heads * hd, cfg.num_kv_heads * hd
  per_token = d * q_width + 2 * d * kv_width + q_width * d + 3 * d * cfg.mlp_dim
  return 2.0 * per_token * tokens


def attention_flops(cfg: transformer.TransformerConfig, batch_size: int, seq_len: int,
                    count: AttentionCount = 'causal') -> float:
  """Forward FLOPs of one layer's attention scores and values over B rows of T tokens."""
  pairs = seq_len * (seq_len + 1) / 2 if count == 'causal' else float(seq_len * seq_len)
  # Scores and values: 2 FLOPs per multiply-add, head_dim each, for every query head.
  return 2 * 2.0 * batch_size * cfg.num_attention_heads * cfg.head_dim * pairs
