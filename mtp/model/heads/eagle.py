"""An EAGLE drafter (Li et al. 2024): one decoder layer, shared by every depth, rolled forward.

The drafter reads the trunk's feature f_t (its last hidden state after the final norm, the
vector the output layer reads) together with the embedding of the token after it:

    x = fc([embed(x_{t+1}); f_t])                          fc: [2D] -> [D], no bias
    f'_{t+1} = layer(x)                                    at position t
    draft logits for x_{t+2} = unembedding(f'_{t+1})       the trunk's shared output layer

`layer` is a Llama decoder layer without its input norm (EAGLE's first layer skips it), and
the predicted feature lives in the trunk's normed space (it regresses onto f_{t+1}), so the
output layer reads it as it is. Depth k rolls the same weights forward: at position t+k-1 it
reads [embed(drafted x_{t+k}); f'_{t+k-1}], its own previous prediction.

Attention. The drafter keeps one KV-cache layer after the trunk's. Slot s holds the drafter's
keys from the trunk's true feature f_s and token x_{s+1}; a depth k >= 2 query at position
t+k-1 sees those slots up to t and the drafter's own entries t+1 .. t+k-1 written by the
earlier depths of this draft (as EAGLE's drafting does). Drafting therefore runs the layer over
the whole accepted run once (depth 1, the run's slots), then one token per row for each deeper
depth. Those deeper entries sit past the committed length: the next draft overwrites them.

Training (`model.eagle_train_features`):
  * 'drafted' (the default): depth k reads the true token x_{t+k} and its own predicted feature
    f'^{k-1}, and attends exactly as in drafting (the depth-1 entries of earlier positions, then
    its own chain), all depths in one pass: EAGLE-3's "training-time test". It costs K layer
    passes over K*T keys per step.
  * 'trunk': only depth 1 is trained, on the trunk's features (EAGLE-1); head k's output at t is
    depth 1's at t+k-1.
  The feature-regression loss (smooth L1 between f'^k_t and the trunk's f_{t+k}, weighted by
  `model.eagle_feature_loss_weight`) joins the token loss through `feature_loss_weight`.
  The defaults come from benchmarks/drafters.py (demo trunk frozen, 150 steps of teacher
  targets, K=4, held-out code sampled at temperature 0.8, tokens per chain step): 'drafted'
  1.322 against 'trunk' 1.318 (a tie at depths 1-2; depths 3-4 accepted 0.037 and 0.016 of the
  steps against 0.029 and 0.011); feature weight 1: 1.322, 0: 1.293, 10: 1.306. Medusa: 1.218.

Serving format (`hf_export`): vLLM's EAGLE-1 checkpoint for Llama (`EagleLlamaForCausalLM`,
vLLM `model_executor/models/llama_eagle.py`), in the export's `eagle/` directory, the layout of
the published EAGLE Llama drafters (e.g. yuhuili/EAGLE-LLaMA3.1-Instruct-8B):
  * config.json: a one-layer Llama config (`architectures: ["LlamaForCausalLM"]`, which vLLM's
    EAGLEConfig renames `EagleLlamaForCausalLM` for `speculative_config={"method": "eagle"}`),
    plus `num_speculative_tokens` (K);
  * `fc.weight` [D, 2D] (its input is [embedding; feature], embedding first, as vLLM
    concatenates), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
    `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`
    (no `input_layernorm`: vLLM replaces it by the identity), and `embed_tokens.weight`, a copy
    of the trunk's (vLLM shares the target's, and reads this copy only under pipeline
    parallelism). No `lm_head`: vLLM shares the target's.
vLLM feeds the target's last hidden state after its final norm, as here, so the drafts agree.
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
from mtp.model import transformer
from mtp.model.heads import sequential

Array = jax.Array

TRAIN_FEATURES = ('drafted', 'trunk')
SUBDIRECTORY = 'eagle'
# Our names inside the layer -> the layer's Hugging Face names (under `layers.0.`).
_LAYER_NAMES = {
    ('attn', 'q_proj'): 'self_attn.q_proj.weight',
    ('attn', 'k_proj'): 'self_attn.k_proj.weight',
    ('attn', 'v_proj'): 'self_attn.v_proj.weight',
    ('attn', 'o_proj'): 'self_attn.o_proj.weight',
    ('mlp', 'gate'): 'mlp.gate_proj.weight',
    ('mlp', 'up'): 'mlp.up_proj.weight',
    ('mlp', 'down'): 'mlp.down_proj.weight',
}
_MLP_NORM = 'post_attention_layernorm.weight'


class EagleLayer(nnx.Module):
  """A Llama decoder layer without its input norm: x + attn(x), then + mlp(norm(x))."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.attn = transformer.Attention(cfg, rngs=rngs)
    self.mlp_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.mlp = transformer.MLP(cfg, rngs=rngs)

  def __call__(self, x: Array, positions: Array, mask: Array, cache=None, lengths=None):
    """x [B, T, D] -> (x [B, T, D], updated (keys, values) or None); see `Attention`."""
    attended, cache = self.attn(x, positions, mask, cache, lengths)
    x = x + attended
    return x + self.mlp(self.mlp_norm(x)), cache


def depth_mask(mask: Array, depth: int, num_depths: int) -> Array:
  """The training mask of depth `depth` (1-based) over the keys of all depths.

  Args:
    mask: [B, 1, T, T] the training mask (causal within each packed document).
    depth: the depth whose queries these are.
    num_depths: K; keys are laid out depth by depth, T slots each.

  Returns:
    [B, 1, T, K*T]: query t sees depth 1's keys as `mask` allows (the trunk-fed entries of
    earlier positions) and, of each depth 2..depth, the key at its own t (its draft chain).
  """
  b, _, t, _ = mask.shape
  own = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, 1, t, t))
  none = jnp.zeros((b, 1, t, t), bool)
  parts = [mask] + [own] * (depth - 1) + [none] * (num_depths - depth)
  return jnp.concatenate(parts, axis=-1)


def shift_left(x: Array, shift: int) -> Array:
  """x [B, T, ...] -> x[:, t + shift] at t, zeros past the end."""
  if not shift:
    return x
  t = x.shape[1]
  pad = [(0, 0), (0, min(shift, t))] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, shift:], pad)[:, :t]


class EagleDrafter(heads.HeadFamily):
  """One EAGLE layer (`layers[0]`) and its input projection `fc`, drafting K tokens."""
  OPTIONS = {
      # Weight of the smooth-L1 feature regression (drafter vs trunk features) beside the heads'
      # token loss. EAGLE's 1.0 against 0.1 for the tokens would be 10 here; 1 measured best of
      # 0, 1 and 10 (benchmarks/drafters.py, see the module docstring).
      'eagle_feature_loss_weight': 1.0,
      # What depths >= 2 read in training: their own predicted features ('drafted', as in
      # drafting) or the trunk's ('trunk': depth 1 alone is trained, EAGLE-1; cheaper, and
      # measured as good at depths 1-2, a little worse deeper).
      'eagle_train_features': 'drafted',
  }

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    d = trunk_cfg.embed_dim
    self.num_heads = num_heads
    self.train_features = options['eagle_train_features']
    self.loss_weight = float(options['eagle_feature_loss_weight'])
    self.fc = nnx.Linear(
        2 * d, d, use_bias=False, dtype=transformer.dtype_of(trunk_cfg.dtype),
        param_dtype=transformer.dtype_of(trunk_cfg.param_dtype),
        kernel_init=transformer.partitioned(nnx.initializers.normal((2 * d) ** -0.5), 'mlp',
                                            'embed'), rngs=rngs)
    self.layers = nnx.List([EagleLayer(trunk_cfg, rngs=rngs)])

  @classmethod
  def validate_options(cls, options: Mapping[str, Any]) -> None:
    if options['eagle_train_features'] not in TRAIN_FEATURES:
      raise ValueError(f'model.eagle_train_features must be one of {", ".join(TRAIN_FEATURES)}, '
                       f'got {options["eagle_train_features"]!r}.')
    weight = options['eagle_feature_loss_weight']
    if not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight < 0:
      raise ValueError(f'model.eagle_feature_loss_weight must be a finite number >= 0, got '
                       f'{weight!r}.')

  @property
  def num_cache_layers(self) -> int:
    return 1

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    """Its 2D -> D projection and its layer, run once per depth (K times, each depth attending
    to the earlier depths' keys too), or once with `eagle_train_features='trunk'`."""
    tokens = batch_size * seq_len
    projection = sequential.projection_flops(trunk_cfg, tokens)
    block = flops.block_matmul_flops(trunk_cfg, tokens)
    if options['eagle_train_features'] == 'trunk':  # Depth 1 only, then shifted.
      attention = flops.attention_flops(trunk_cfg, batch_size, seq_len, count)
      return flops.HeadFlops(projection + block, attention, block + attention)
    # Every depth runs the shared layer over all T positions. Depth d's queries attend to depth
    # 1's keys causally and to one key of each earlier depth; the program scores them against
    # all K*T keys of its buffer.
    k, cfg = num_heads, trunk_cfg
    per_depth = [flops.attention_flops(cfg, batch_size, seq_len, count) +
                 (4.0 * batch_size * cfg.num_attention_heads * cfg.head_dim * seq_len
                  * ((d - 1) if count == 'causal' else (k - 1) * seq_len))
                 for d in range(1, k + 1)]
    return flops.HeadFlops(k * (projection + block), sum(per_depth), 0.0)  # Not rematerialised.

  @property
  def feature_loss_weight(self) -> float:
    return self.loss_weight

  def _input(self, trunk, next_tokens: Array, features: Array) -> Array:
    """fc([embed(next_tokens); features]): [B, T] and [B, T, D] -> [B, T, D]."""
    embeds = trunk.embed(next_tokens).astype(features.dtype)
    return self.fc(jnp.concatenate([embeds, features], axis=-1))

  def __call__(self, trunk, hidden, normed, tokens, positions, mask) -> list[Array]:
    layer, k = self.layers[0], self.num_heads
    next_embeds = sequential.shifted_embeddings(trunk.embed(tokens), k)
    if self.train_features == 'trunk':
      x = self.fc(jnp.concatenate([next_embeds[0].astype(normed.dtype), normed], axis=-1))
      first, _ = transformer.call_block(layer, x, positions, mask,
                                        remat=trunk.cfg.remat != 'none')
      return [shift_left(first, depth) for depth in range(k)]
    # Every depth's keys and values in one buffer, T slots per depth (see `depth_mask`).
    b, t = tokens.shape
    cfg = trunk.cfg
    dtype = transformer.dtype_of(cfg.dtype)
    shape = (b, k * t, cfg.num_kv_heads, cfg.head_dim)
    layer_cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    outputs, features = [], normed
    for depth in range(1, k + 1):
      x = self.fc(jnp.concatenate([next_embeds[depth - 1].astype(features.dtype), features],
                                  axis=-1))
      features, layer_cache = layer(x, positions + depth - 1, depth_mask(mask, depth, k),
                                    layer_cache, jnp.full((b,), (depth - 1) * t, jnp.int32))
      outputs.append(features)
    return outputs

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer):
    return normed, cache

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    project = heads.DraftProjection(trunk, vocab)
    t = features.shape[1]
    layer = self.layers[0]
    # Depth 1 over the run: slot s reads f_s and x_{s+1} (scratch past last_index + 1, and
    # overwritten by the deeper depths or the next draft).
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    mask = heads.causal_mask(t)
    x = self._input(trunk, tokens[:, 1:1 + t], features)
    h, layer_cache = layer(x, positions, mask, heads.layer_cache(cache, first_layer), lengths)
    feature = kv_cache_lib.gather_rows(h, last_index)  # [B, D]
    logits = [project.logits(feature)]
    slot = lengths + last_index
    for _ in range(1, depth):
      # One new entry per row, right after the previous one; a row at the cache's end writes
      # into its last slot, which no committed token uses (it has finished anyway).
      slot = slot + 1
      drafted = project.token_ids(jnp.argmax(logits[-1], axis=-1)).astype(tokens.dtype)
      x = self._input(trunk, drafted[:, None], feature[:, None])
      h, layer_cache = layer(x, slot[:, None], heads.causal_mask(1), layer_cache, slot)
      feature = h[:, 0]
      logits.append(project.logits(feature))
    return jnp.stack(logits), transformer.replace_layers(cache, first_layer, [layer_cache])

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """vLLM's EAGLE-1 Llama drafter in `eagle/` (see the module docstring)."""
    cfg = context.trunk_cfg
    layer = self.layers[0]
    tensors = {'fc.weight': heads.as_numpy(self.fc.kernel).T,
               'embed_tokens.weight': context.embedding,
               f'layers.0.{_MLP_NORM}': heads.as_numpy(layer.mlp_norm.scale)}
    for (part, name), hf_name in _LAYER_NAMES.items():
      tensors[f'layers.0.{hf_name}'] = heads.as_numpy(getattr(getattr(layer, part), name).kernel).T
    config = {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
        'vocab_size': cfg.vocab_size, 'hidden_size': cfg.embed_dim,
        'intermediate_size': cfg.mlp_dim, 'num_hidden_layers': 1,
        'num_attention_heads': cfg.num_attention_heads, 'num_key_value_heads': cfg.num_kv_heads,
        'head_dim': cfg.head_dim, 'max_position_embeddings': cfg.max_seq_len,
        'rms_norm_eps': cfg.norm_eps, 'hidden_act': 'silu', 'attention_bias': False,
        'mlp_bias': False, 'tie_word_embeddings': cfg.tie_embeddings,
        'rope_theta': cfg.rope_theta, 'rope_scaling': None,
        'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
        'num_speculative_tokens': self.num_heads,
    }
    return heads.HFExport(format='vllm-eagle',
                          subdirectories={SUBDIRECTORY: heads.HFSubdirectory(config, tensors)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """`eagle/` in vLLM's EAGLE-1 format, `hf_export`'s inverse. K is `num_speculative_tokens`
    (1 when absent: a published drafter does not say); an `embed_tokens` copy must be the base
    model's; `fc.bias` and `input_layernorm` are refused (vLLM's EAGLE-1 Llama has neither)."""
    sub = source.subdirectory(SUBDIRECTORY)
    if sub is None:
      return None
    where = f'{SUBDIRECTORY}/: '
    cfg = source.trunk_cfg
    if int(sub.config.get('num_hidden_layers', 1)) != 1:
      raise ValueError(f'{where}config.json has num_hidden_layers '
                       f'{sub.config["num_hidden_layers"]}; mtp\'s EAGLE drafter has one layer.')
    for name in ('fc.bias', 'layers.0.input_layernorm.weight'):
      if name in sub.tensors:
        raise ValueError(f'{where}{name} is not part of vLLM\'s EAGLE-1 Llama drafter; this '
                         'drafter cannot be imported.')
    t = sub.tensors
    expected = {'fc.weight': (cfg.embed_dim, 2 * cfg.embed_dim)}
    fc = heads.take(t, 'fc.weight', where)
    if fc.shape != expected['fc.weight']:
      raise ValueError(f'{where}fc.weight has shape {list(fc.shape)}, expected '
                       f'{list(expected["fc.weight"])} for the base model.')
    heads.check_shared(t, 'embed_tokens.weight', source.embedding, 'embedding', where)
    layer: dict[str, Any] = {'attn': {}, 'mlp': {},
                             'mlp_norm': {'scale': heads.take(t, f'layers.0.{_MLP_NORM}', where)}}
    for (part, name), hf_name in _LAYER_NAMES.items():
      layer[part][name] = {'kernel': heads.take(t, f'layers.0.{hf_name}', where).T}
    num_heads = int(sub.config.get('num_speculative_tokens') or 1)
    return heads.HFImport(num_heads=num_heads, options={},
                          params={'fc': {'kernel': fc.T}, 'layers': {0: layer}})
