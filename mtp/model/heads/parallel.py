"""Parallel heads (Gloeckle et al. 2024): one transformer layer per head, then a norm.

Every head reads the trunk's last (pre-norm) hidden state and attends over earlier positions,
so each keeps a KV-cache layer. The heads run inside the verification pass (their layers see
the same tokens as the trunk's), and drafting only gathers their outputs at the last accepted
token.

Serving format (`hf_export`): no serving system runs these heads, so the layout is this
project's, in the export's `parallel_heads/` directory:
  * `config.json`: `model_type` "mtp_parallel_heads", `num_heads` K, and the Llama keys of the
    blocks' shape (`hidden_size`, `intermediate_size`, `num_attention_heads`,
    `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta`, `hidden_act`);
  * `model.safetensors`: head k (0-based, predicting token t+2+k from position t) as Llama layer
    k, `model.layers.{k}.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
    mlp.{gate,up,down}_proj}.weight` (the half-split rotary layout of Hugging Face Llama), plus
    its output norm `model.layers.{k}.norm.weight`.
Head k reads the base model's last hidden state h_0 *before* its final norm, runs its layer
causally over the sequence (its own KV cache, the trunk's positions), applies its norm, and
projects through the base model's output layer (`lm_head`, or the embedding when tied):
  logits_k = lm_head(norm_k(layer_k(h_0))).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import flops
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

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    """One transformer layer per head, which remat recomputes whole."""
    block = num_heads * flops.block_matmul_flops(trunk_cfg, batch_size * seq_len)
    attention = num_heads * flops.attention_flops(trunk_cfg, batch_size, seq_len, count)
    return flops.HeadFlops(block, attention, block + attention)

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
    outputs, updated = self._run(hidden, positions, block_mask, cache, lengths, first_layer)
    features = jnp.stack(outputs, axis=2)  # [B, T, K, D]
    return features, transformer.replace_layers(cache, first_layer, updated)

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """The layout in the module docstring (`parallel_heads/`)."""
    cfg = context.trunk_cfg
    tensors = {}
    for k, layer in enumerate(self.layers):
      tensors.update(context.block_tensors(layer.block, k))
      tensors[f'model.layers.{k}.norm.weight'] = heads.as_numpy(layer.norm.scale)
    config = {
        'model_type': 'mtp_parallel_heads', 'architectures': ['MTPParallelHeads'],
        'num_heads': len(self.layers), 'hidden_size': cfg.embed_dim,
        'intermediate_size': cfg.mlp_dim, 'num_attention_heads': cfg.num_attention_heads,
        'num_key_value_heads': cfg.num_kv_heads, 'head_dim': cfg.head_dim,
        'rms_norm_eps': cfg.norm_eps, 'rope_theta': cfg.rope_theta, 'hidden_act': 'silu',
        'vocab_size': cfg.vocab_size, 'max_position_embeddings': cfg.max_seq_len,
        'description': ('Gloeckle et al. parallel heads: logits_k = lm_head(norm_k(layer_k(h)))'
                        ' where h is the base model\'s last hidden state before its final norm '
                        'and lm_head is the base model\'s output layer; layer k is a causal '
                        'Llama layer over the sequence.'),
    }
    return heads.HFExport(
        format='mtp-parallel-heads',
        subdirectories={'parallel_heads': heads.HFSubdirectory(config, tensors)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """`parallel_heads/` in the layout of the module docstring."""
    sub = source.subdirectory('parallel_heads')
    if sub is None:
      return None
    if sub.config.get('model_type') != 'mtp_parallel_heads' or 'num_heads' not in sub.config:
      raise ValueError('parallel_heads/config.json is not an mtp_parallel_heads config.')
    layers = {k: {'block': source.block_params(sub.tensors, k),
                  'norm': {'scale': heads.take(sub.tensors, f'model.layers.{k}.norm.weight',
                                               'parallel_heads/: ')}}
              for k in range(int(sub.config['num_heads']))}
    return heads.HFImport(num_heads=len(layers), options={}, params={'layers': layers})

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    at_last = kv_cache_lib.gather_rows(features, last_index)  # [B, K, D]
    outputs = jnp.moveaxis(at_last, 1, 0)[:depth]  # [depth, B, D]
    return heads.DraftProjection(trunk, vocab).logits(outputs), cache
