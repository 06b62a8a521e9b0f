"""Medusa heads (Cai et al. 2024): ResBlocks on the trunk's normalised last hidden state.

Each residual branch starts at zero, so every head starts out predicting what the trunk
predicts. The heads do not attend: they need no cache, and they stay out of the verification
pass (they draft from the trunk's normed states, gathered at the last accepted token).

Serving format (`hf_export`): vLLM's Medusa checkpoint (vLLM `model_executor/models/medusa.py`,
config class `transformers_utils/configs/medusa.py`), in the export's `medusa/` directory.
vLLM's Medusa reads the target model's last hidden state after its final norm, as these heads do.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.model import flops
from mtp.model import heads
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import products
from mtp.model import transformer

Array = jax.Array


class ResBlock(nnx.Module):
  """x + silu(W x + b), W and b initialised to zero (Medusa)."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(
        cfg.embed_dim, cfg.embed_dim, dtype=transformer.dtype_of(cfg.dtype),
        param_dtype=transformer.dtype_of(cfg.param_dtype), dot_general=products.dot_general,
        kernel_init=transformer.partitioned(nnx.initializers.zeros_init(), 'embed', 'mlp'),
        bias_init=transformer.partitioned(nnx.initializers.zeros_init(), 'mlp'), rngs=rngs)

  def __call__(self, x: Array) -> Array:
    return x + jax.nn.silu(self.linear(x))


class MedusaHead(nnx.Module):
  """One head: `num_layers` ResBlocks in a row."""

  def __init__(self, cfg: transformer.TransformerConfig, num_layers: int, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([ResBlock(cfg, rngs=rngs) for _ in range(num_layers)])

  def __call__(self, x: Array) -> Array:
    for block in self.blocks:
      x = block(x)
    return x


class MedusaHeads(heads.HeadFamily):
  """K heads of `medusa_num_layers` ResBlocks each, on the trunk's normalised hidden state."""
  OPTIONS = {'medusa_num_layers': 1}  # ResBlocks per head

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    self.layers = nnx.List([MedusaHead(trunk_cfg, options['medusa_num_layers'], rngs=rngs)
                            for _ in range(num_heads)])

  @classmethod
  def validate_options(cls, options: Mapping[str, Any]) -> None:
    if options['medusa_num_layers'] < 1:
      raise ValueError(
          f'model.medusa_num_layers must be >= 1, got {options["medusa_num_layers"]}.')

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    """K x `medusa_num_layers` D x D ResBlocks over every token; no attention, no remat."""
    layers, d, tokens = options['medusa_num_layers'], trunk_cfg.embed_dim, batch_size * seq_len
    return flops.HeadFlops(num_heads * layers * 2.0 * d * d * tokens, 0.0, 0.0)

  def __call__(self, trunk, hidden, normed, tokens, positions, mask) -> list[Array]:
    return [head(normed) for head in self.layers]

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer):
    return normed, cache

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """vLLM's Medusa format: `blocks.{i}.layers.{j}.weight` [D, D] ([out, in]) and `.bias` [D]
    (ResBlock j of head i: x + SiLU(W x + b)), then `lm_heads.{i}.weight` [V, D].

    The heads share the trunk's output layer, so every `lm_heads.{i}` holds a copy of it and
    `original_lm_head` says so (vLLM then keeps one). The config holds only Medusa's keys: vLLM's
    loader renames every key containing "num" and "heads"/"layers" to num_heads /
    num_hidden_layers, so a base model's `num_attention_heads` would overwrite them.
    """
    cfg = context.trunk_cfg
    tensors = {}
    for i, head in enumerate(self.layers):
      for j, block in enumerate(head.blocks):
        tensors[f'blocks.{i}.layers.{j}.weight'] = heads.as_numpy(block.linear.kernel).T
        tensors[f'blocks.{i}.layers.{j}.bias'] = heads.as_numpy(block.linear.bias)
      tensors[f'lm_heads.{i}.weight'] = context.unembedding
    config = {'model_type': 'medusa', 'architectures': ['MedusaModel'],
              'hidden_size': cfg.embed_dim, 'vocab_size': cfg.vocab_size,
              'num_heads': len(self.layers), 'num_hidden_layers': len(self.layers[0].blocks),
              'medusa_fc_bias': True, 'original_lm_head': True}
    return heads.HFExport(format='vllm-medusa',
                          subdirectories={'medusa': heads.HFSubdirectory(config, tensors)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """`medusa/` in vLLM's Medusa format. Counts are read as vLLM's config loader reads them
    (a key holding "num" and "heads" or "layers", so `medusa_num_heads` works too); a missing
    bias is zero (`medusa_fc_bias` false)."""
    sub = source.subdirectory('medusa')
    if sub is None:
      return None
    where = 'medusa/: '
    counts = {}
    for key, value in sub.config.items():
      if 'num' in key and ('heads' in key or 'layers' in key):
        counts['heads' if 'heads' in key else 'layers'] = int(value)
    if sub.config.get('model_type') != 'medusa' or set(counts) != {'heads', 'layers'}:
      raise ValueError(f'{where}config.json is not a Medusa config (model_type "medusa", '
                       'num_heads, num_hidden_layers).')
    d = source.trunk_cfg.embed_dim
    layers = {}
    for i in range(counts['heads']):
      blocks = {}
      for j in range(counts['layers']):
        name = f'blocks.{i}.layers.{j}.'
        weight = heads.take(sub.tensors, name + 'weight', where)
        if weight.shape != (d, d):
          raise ValueError(f'{where}{name}weight has shape {list(weight.shape)}, expected '
                           f'[{d}, {d}] for the base model.')
        bias = sub.tensors.get(name + 'bias', np.zeros(d, np.float32))
        blocks[j] = {'linear': {'kernel': weight.T, 'bias': bias}}
      heads.check_shared(sub.tensors, f'lm_heads.{i}.weight', source.unembedding,
                         'output layer', where)
      layers[i] = {'blocks': blocks}
    return heads.HFImport(num_heads=counts['heads'],
                          options={'medusa_num_layers': counts['layers']},
                          params={'layers': layers})

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    # The cheap ResBlocks run on the one gathered position, not on the whole run.
    normed = kv_cache_lib.gather_rows(features, last_index)  # [B, D]
    outputs = jnp.stack([self.layers[k](normed) for k in range(depth)])
    return heads.DraftProjection(trunk, vocab).logits(outputs), cache
