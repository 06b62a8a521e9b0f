"""Parallel heads (Gloeckle et al. 2024): one transformer layer per head, then a norm.

Every head reads the trunk's last (pre-norm) hidden state and attends over earlier positions,
so each keeps a KV-cache layer. The heads run inside the verification pass (their layers see
the same tokens as the trunk's), and drafting only gathers their outputs at the last accepted
token.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import heads
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer

Array = jax.Array


class ParallelLayer(nnx.Module):
  """One head: a transformer layer (`block`) and its output norm (`norm`)."""

  def __init__(self, block: transformer.Block, norm: nnx.RMSNorm):
    self.block = block
    self.norm = norm


class ParallelHeads(heads.HeadFamily):
  """K independent transformer layers on the trunk's last hidden state."""
  RUNS_IN_VERIFICATION = True

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    # Every block before every norm: the random stream, hence the initial values, stays what
    # it was when the two were separate lists.
    blocks = [transformer.Block(trunk_cfg, rngs=rngs) for _ in range(num_heads)]
    norms = [transformer.rms_norm(trunk_cfg, rngs=rngs) for _ in range(num_heads)]
    self.layers = nnx.List([ParallelLayer(b, n) for b, n in zip(blocks, norms)])
    self.remat = trunk_cfg.remat != 'none'

  @property
  def num_cache_layers(self) -> int:
    return len(self.layers)

  def _run(self, hidden, positions, mask, cache=None, lengths=None, first_layer=0):
    """hidden [B, T, D] -> (K normalised outputs [B, T, D], updated (keys, values) per head)."""
    outputs, updated = [], []
    for i, layer in enumerate(self.layers):
      x, layer_cache = transformer.call_block(
          layer.block, hidden, positions, mask, heads.layer_cache(cache, first_layer + i),
          lengths, remat=self.remat)
      outputs.append(layer.norm(x))
      updated.append(layer_cache)
    return outputs, updated

  def __call__(self, trunk, hidden, normed, tokens, positions, mask) -> list[Array]:
    return self._run(hidden, positions, mask)[0]

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer):
    mask = transformer.cached_mask(lengths, block_mask, cache.capacity)
    outputs, updated = self._run(hidden, positions, mask, cache, lengths, first_layer)
    features = jnp.stack(outputs, axis=2)  # [B, T, K, D]
    return features, transformer.replace_layers(cache, first_layer, updated)

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer):
    at_last = kv_cache_lib.gather_rows(features, last_index)  # [B, K, D]
    outputs = jnp.moveaxis(at_last, 1, 0)[:depth]  # [depth, B, D]
    return trunk.logits(outputs), cache
