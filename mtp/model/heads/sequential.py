"""Sequential heads: DeepSeek-V3 MTP modules.

Module k combines norm(h_{k-1}(t)) with norm(embed(x_{t+k})), projects 2D -> D and runs one
transformer layer; h_0 is the trunk's last hidden state. Embedding and output layer are shared
with the trunk. Each module attends, so it keeps a KV-cache layer. The modules stay out of the
verification pass: module k needs token x_{t+k}, which is known only after verification, so
drafting runs them over the accepted run (features: the trunk's hidden states there), feeding
each module's top-1 draft to the next.

Serving format (`hf_export`): DeepSeek-V3's MTP layers (as vLLM's `deepseek_mtp.py` loads them),
stored in the Hugging Face directory as layers L.. after the trunk's L, with
`num_nextn_predict_layers` in config.json. Two differences from vLLM's DeepSeek MTP remain, and
both touch only the drafts (verification keeps the output exact):
  * vLLM feeds the first module the target's hidden state after its final norm; module 1 here
    reads h_0 before it. `hnorm` rescales either, so they agree exactly only when the final
    norm's scale is uniform across features.
  * vLLM zeroes the token embedding at position 0; these modules do not.
vLLM has no model class that runs DeepSeek MTP layers around Llama blocks, and its Llama loader
looks up every tensor name it reads, so it refuses a directory holding these layers (transformers
ignores them with a warning, and `import_weights` reads them back as heads).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.model import argmax as argmax_lib
from mtp.model import flops
from mtp.model import heads
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import products
from mtp.model import transformer

Array = jax.Array


class SequentialModule(nnx.Module):
  """One DeepSeek-V3 MTP module: block(proj([norm(h_prev); norm(embed(next_token))]))."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.remat = cfg.remat != 'none'
    self.hidden_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.embed_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.proj = nnx.Linear(
        2 * cfg.embed_dim, cfg.embed_dim, use_bias=False, dtype=transformer.dtype_of(cfg.dtype),
        param_dtype=transformer.dtype_of(cfg.param_dtype), dot_general=products.dot_general,
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


def shifted_embeddings(embeds: Array, num_heads: int) -> list[Array]:
  """embeds [B, T, D] of x_t -> K arrays [B, T, D]: entry k-1 is embed(x_{t+k}) at t, zeros
  past the end."""
  t = embeds.shape[1]
  out = []
  for k in range(1, num_heads + 1):
    out.append(jnp.pad(embeds[:, k:], ((0, 0), (0, min(k, t)), (0, 0)))[:, :t])
  return out


def projection_flops(cfg: transformer.TransformerConfig, tokens: int) -> float:
  """Forward FLOPs of the [2D] -> [D] projection of [hidden; embedding] over `tokens`."""
  return 2.0 * (2 * cfg.embed_dim) * cfg.embed_dim * tokens


class SequentialHeads(heads.HeadFamily):
  """K chained MTP modules; module k sees the embedding of token t+k."""

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    self.layers = nnx.List([SequentialModule(trunk_cfg, rngs=rngs) for _ in range(num_heads)])

  @property
  def num_cache_layers(self) -> int:
    return len(self.layers)

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    """A 2D -> D projection and one transformer layer per module; remat recomputes the layers
    (`transformer.call_block`), not the projections."""
    tokens = batch_size * seq_len
    block = flops.block_matmul_flops(trunk_cfg, tokens)
    attention = num_heads * flops.attention_flops(trunk_cfg, batch_size, seq_len, count)
    return flops.HeadFlops(num_heads * (projection_flops(trunk_cfg, tokens) + block), attention,
                           num_heads * block + attention)

  def __call__(self, trunk, hidden, normed, tokens, positions, mask) -> list[Array]:
    outputs, h = [], hidden
    for module, embeds in zip(self.layers, shifted_embeddings(trunk.embed(tokens),
                                                              len(self.layers))):
      h, out, _ = module(h, embeds, positions, mask)
      outputs.append(out)
    return outputs

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer):
    return hidden, cache

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    project = heads.DraftProjection(trunk, vocab)
    t = features.shape[1]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    h, logits = features, []
    for k in range(depth):
      h, normed, cache = self.module_step(trunk, k, h, tokens[:, k + 1:k + 1 + t], positions,
                                          cache, lengths, first_layer)
      head = project.logits(kv_cache_lib.gather_rows(normed, last_index))  # [B, V or N]
      logits.append(head)
      if k + 1 < depth:  # Module k + 2 reads this draft as token x_{t + k + 2} at last_index.
        top1 = project.token_ids(argmax_lib.argmax(head)).astype(tokens.dtype)
        tokens = kv_cache_lib.write_rows(tokens, top1[:, None], last_index + k + 2)
    return jnp.stack(logits), cache

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """Module k as DeepSeek-V3 MTP layer L + k: `enorm`, `hnorm`, `eh_proj` [D, 2D],
    `shared_head.norm`, `shared_head.head` [V, D] (the shared output layer), and the block under
    the usual Llama names; the first also carries the shared `embed_tokens` [V, D], where vLLM
    reads it.

    vLLM computes eh_proj(cat[enorm(embedding), hnorm(hidden)]), embedding half first; `proj`
    here reads [hidden; embedding], so the two halves of its input columns are swapped.
    """
    cfg = context.trunk_cfg
    d = cfg.embed_dim
    tensors = {}
    for k, module in enumerate(self.layers):
      prefix = f'model.layers.{cfg.num_layers + k}.'
      weight = heads.as_numpy(module.proj.kernel).T  # [D, 2D]: columns [hidden | embedding]
      if k == 0:
        tensors[prefix + 'embed_tokens.weight'] = context.embedding
      tensors[prefix + 'enorm.weight'] = heads.as_numpy(module.embed_norm.scale)
      tensors[prefix + 'hnorm.weight'] = heads.as_numpy(module.hidden_norm.scale)
      tensors[prefix + 'eh_proj.weight'] = np.concatenate([weight[:, d:], weight[:, :d]], axis=1)
      tensors.update(context.block_tensors(module.block, cfg.num_layers + k))
      tensors[prefix + 'shared_head.norm.weight'] = heads.as_numpy(module.out_norm.scale)
      tensors[prefix + 'shared_head.head.weight'] = context.unembedding
    return heads.HFExport(format='deepseek-v3-mtp', tensors=tensors,
                          config={'num_nextn_predict_layers': len(self.layers)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """MTP layers L.. (`num_nextn_predict_layers`), `hf_export`'s inverse: eh_proj's halves are
    swapped back; shared_head.head and embed_tokens, where present, must be the base model's."""
    count = int(source.config.get('num_nextn_predict_layers') or 0)
    if not count:
      return None
    cfg, t = source.trunk_cfg, source.tensors
    d = cfg.embed_dim
    layers = {}
    for k in range(count):
      prefix = f'model.layers.{cfg.num_layers + k}.'
      weight = heads.take(t, prefix + 'eh_proj.weight')  # [D, 2D]: [embedding | hidden]
      if weight.shape != (d, 2 * d):
        raise ValueError(f'{prefix}eh_proj.weight has shape {list(weight.shape)}, expected '
                         f'[{d}, {2 * d}].')
      heads.check_shared(t, prefix + 'shared_head.head.weight', source.unembedding,
                         'output layer')
      heads.check_shared(t, prefix + 'embed_tokens.weight', source.embedding, 'embedding')
      layers[k] = {
          'hidden_norm': {'scale': heads.take(t, prefix + 'hnorm.weight')},
          'embed_norm': {'scale': heads.take(t, prefix + 'enorm.weight')},
          'proj': {'kernel': np.concatenate([weight[:, d:], weight[:, :d]], axis=1).T},
          'block': source.block_params(t, cfg.num_layers + k),
          'out_norm': {'scale': heads.take(t, prefix + 'shared_head.norm.weight')},
      }
    return heads.HFImport(num_heads=count, options={}, params={'layers': layers})

  def module_step(self, trunk, index: int, hidden_prev: Array, next_tokens: Array,
                  positions: Array, cache: kv_cache_lib.KVCache, lengths: Array,
                  first_layer: int):
    """Runs module `index` (0-based) on a chain of T tokens with its cache layer.

    Args:
      hidden_prev: [B, T, D] h_{k-1} at the T positions.
      next_tokens: [B, T] x_{t+k} at each position t (drafts where not yet known).
      positions: [B, T] the positions, written at slots [lengths, lengths + T).

    Returns:
      (h_k [B, T, D], normalised output [B, T, D], updated cache).
    """
    mask = heads.causal_mask(next_tokens.shape[1])
    layer = first_layer + index
    h, out, layer_cache = self.layers[index](
        hidden_prev, trunk.embed(next_tokens), positions, mask, heads.layer_cache(cache, layer),
        lengths)
    return h, out, transformer.replace_layers(cache, layer, [layer_cache])
