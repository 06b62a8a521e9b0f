"""Multi-token prediction heads. Head k (1..K) predicts token t+1+k from position t.

Every family returns, per head, hidden states ready for the shared unembedding (already
normalised), so the loss and the drafter treat all families alike:

* `medusa`: ResBlocks on the trunk's normalised last hidden state (Cai et al. 2024). The
  residual branch starts at zero, so every head starts out predicting what the trunk predicts.
* `parallel`: one transformer layer per head on the trunk's last hidden state, then a norm
  (Gloeckle et al. 2024). Each layer attends over earlier positions, so decoding keeps a KV
  cache layer per head.
* `sequential`: DeepSeek-V3 MTP modules. Module k combines norm(h_{k-1}(t)) with
  norm(embed(x_{t+k})), projects 2D -> D and runs one transformer layer; h_0 is the trunk's last
  hidden state. Embedding and output head are shared with the trunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer

Array = jax.Array
HEAD_TYPES = ('medusa', 'parallel', 'sequential')


class ResBlock(nnx.Module):
  """x + silu(W x + b), W and b initialised to zero (Medusa)."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(
        cfg.embed_dim, cfg.embed_dim, dtype=transformer.dtype_of(cfg.dtype),
        param_dtype=transformer.dtype_of(cfg.param_dtype),
        kernel_init=transformer.partitioned(nnx.initializers.zeros_init(), 'embed', 'mlp'),
        bias_init=transformer.partitioned(nnx.initializers.zeros_init(), 'mlp'), rngs=rngs)

  def __call__(self, x: Array) -> Array:
    return x + jax.nn.silu(self.linear(x))


class MedusaHeads(nnx.Module):
  """K heads of `num_layers` ResBlocks each, on the trunk's normalised hidden state."""
  num_cache_layers = 0

  def __init__(self, cfg: transformer.TransformerConfig, num_heads: int, num_layers: int, *,
               rngs: nnx.Rngs):
    self.heads = nnx.List([
        nnx.List([ResBlock(cfg, rngs=rngs) for _ in range(num_layers)])
        for _ in range(num_heads)])

  def __call__(self, normed: Array) -> list[Array]:
    """normed [..., D] -> K arrays [..., D]."""
    outputs = []
    for blocks in self.heads:
      x = normed
      for block in blocks:
        x = block(x)
      outputs.append(x)
    return outputs


class ParallelHeads(nnx.Module):
  """K independent transformer layers on the trunk's last (pre-norm) hidden state."""

  def __init__(self, cfg: transformer.TransformerConfig, num_heads: int, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([transformer.Block(cfg, rngs=rngs) for _ in range(num_heads)])
    self.norms = nnx.List([transformer.rms_norm(cfg, rngs=rngs) for _ in range(num_heads)])
    self.num_cache_layers = num_heads
    self.remat = cfg.remat != 'none'

  def __call__(self, hidden: Array, positions: Array, mask: Array,
               cache: kv_cache_lib.KVCache | None = None, lengths: Array | None = None,
               first_layer: int = 0):
    """hidden [B, T, D] -> (K arrays [B, T, D], updated (keys, values) per head or [])."""
    outputs, updated = [], []
    for i, (block, norm) in enumerate(zip(self.blocks, self.norms)):
      layer_cache = None
      if cache is not None:
        layer_cache = (cache.keys[first_layer + i], cache.values[first_layer + i])
      x, layer_cache = transformer.call_block(block, hidden, positions, mask, layer_cache,
                                              lengths, remat=self.remat)
      outputs.append(norm(x))
      updated.append(layer_cache)
    return outputs, updated


class SequentialModule(nnx.Module):
  """One DeepSeek-V3 MTP module: block(proj([norm(h_prev); norm(embed(next_token))]))."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.remat = cfg.remat != 'none'
    self.hidden_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.embed_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.proj = nnx.Linear(
        2 * cfg.embed_dim, cfg.embed_dim, use_bias=False, dtype=transformer.dtype_of(cfg.dtype),
        param_dtype=transformer.dtype_of(cfg.param_dtype),
        kernel_init=transformer.partitioned(
            nnx.initializers.normal((2 * cfg.embed_dim) ** -0.5), 'mlp', 'embed'), rngs=rngs)
    self.block = transformer.Block(cfg, rngs=rngs)
    self.out_norm = transformer.rms_norm(cfg, rngs=rngs)

  def __call__(self, hidden_prev: Array, token_embeds: Array, positions: Array, mask: Array,
               layer_cache=None, lengths=None):
    """Returns (h_k [B, T, D] pre-norm, normalised output [B, T, D], updated layer cache)."""
    combined = jnp.concatenate([self.hidden_norm(hidden_prev), self.embed_norm(token_embeds)], -1)
    h, layer_cache = transformer.call_block(self.block, self.proj(combined), positions, mask,
                                            layer_cache, lengths, remat=self.remat)
    return h, self.out_norm(h), layer_cache


class SequentialHeads(nnx.Module):
  """K chained MTP modules; module k sees the embedding of token t+k."""

  def __init__(self, cfg: transformer.TransformerConfig, num_heads: int, *, rngs: nnx.Rngs):
    self.layers = nnx.List([SequentialModule(cfg, rngs=rngs) for _ in range(num_heads)])
    self.num_cache_layers = num_heads

  def __call__(self, hidden: Array, shifted_embeds: list[Array], positions: Array, mask: Array,
               cache: kv_cache_lib.KVCache | None = None, lengths: Array | None = None,
               first_layer: int = 0):
    """Runs the chain.

    Args:
      hidden: [B, T, D] the trunk's last hidden state (h_0).
      shifted_embeds: K arrays [B, T, D]; entry k-1 is embed(x_{t+k}) at position t.

    Returns:
      (K normalised outputs [B, T, D], updated (keys, values) per module or []).
    """
    outputs, updated = [], []
    h = hidden
    for i, module in enumerate(self.layers):
      layer_cache = None
      if cache is not None:
        layer_cache = (cache.keys[first_layer + i], cache.values[first_layer + i])
      h, out, layer_cache = module(h, shifted_embeds[i], positions, mask, layer_cache, lengths)
      outputs.append(out)
      updated.append(layer_cache)
    return outputs, updated
