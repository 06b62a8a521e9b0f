"""An EAGLE drafter (Li et al. 2024): one decoder layer, shared by every depth, rolled forward;
with EAGLE-3's fused features and input layer as options (Li et al. 2025, arXiv 2503.01840).

The drafter reads the trunk's feature f_t (its last hidden state after the final norm, the
vector the output layer reads) together with the embedding of the token after it:

    x = fc([embed(x_{t+1}); f_t])                          fc: [2D] -> [D], no bias
    f'_{t+1} = layer(x)                                    at position t
    draft logits for x_{t+2} = unembedding(f'_{t+1})       the trunk's shared output layer

`layer` is a Llama decoder layer without its input norm (EAGLE's first layer skips it), and
the predicted feature lives in the trunk's normed space (it regresses onto f_{t+1}), so the
output layer reads it as it is. Depth k rolls the same weights forward: at position t+k-1 it
reads [embed(drafted x_{t+k}); f'_{t+k-1}], its own previous prediction.

EAGLE-3 (two independent options; both together are EAGLE-3's drafter, vLLM's `llama_eagle3`):
  * `model.eagle_features='fused'`: depth 1 reads, instead of f_t, the fused feature
        g_t = fuse([u^low_t; u^mid_t; u^high_t])            fuse: [n*D] -> [D], no bias
    where u^i_t is the trunk's residual stream entering layer i (`trunk_layer_inputs`; not
    normed). The layers are `model.eagle_fused_layers`, by default EAGLE-3's low, middle and
    high ones: 2, L//2 and L-3, each clamped into [0, L-1] and repeats dropped, so trunks of
    fewer than 7 layers fuse fewer than three (L=2: layers 0 and 1; L=5: layer 2 alone).
    Deeper depths read the drafter's own previous output, as before. `fuse` is the
    projection vLLM and EAGLE-3 call `fc`; here `fc` keeps its EAGLE-1 meaning.
  * `model.eagle_input='concat'`: EAGLE-3's layer. Its queries, keys and values read the
    2D-wide [input_norm(embed(x_{t+1})); hidden_norm(f)], the residual added after attention
    is the feature f itself (not the embedding), then mlp_norm + MLP as in Llama; the output
    h (before any norm) is what the next depth reads as f, and the output layer reads
    norm(h), the drafter's own final norm. There is no `fc`. Norm placement and residual are
    vLLM's `llama_eagle3` (`norm_before_residual` false, its default), SafeAILab/EAGLE's
    `traineagle3` midlayer: in vLLM's names input_layernorm, hidden_norm, self_attn (q/k/v
    [2D] -> ...), post_attention_layernorm, mlp, and the model's `norm`.
  EAGLE-3 trains without the feature regression: set `model.eagle_feature_loss_weight=0`
  (its default, 1, is EAGLE-1's; with 'concat' the regression would pull norm(h) onto the
  trunk's f_{t+k}). configs/smollm2_eagle3.py sets all three.

Attention. The drafter keeps one KV-cache layer after the trunk's. Slot s holds the drafter's
keys from the trunk's true feature f_s (or g_s) and token x_{s+1}; a depth k >= 2 query at
position t+k-1 sees those slots up to t and the drafter's own entries t+1 .. t+k-1 written by
the earlier depths of this draft (as EAGLE's drafting does). Drafting therefore runs the layer
over the whole accepted run once (depth 1, the run's slots), then one token per row for each
deeper depth. Those deeper entries sit past the committed length: the next draft overwrites
them. With fused features, `verify` returns g_t for every new token (the trunk hands it the
layers' inputs), so drafting reads them as it reads f_t.

Trees (`draft_tree`, EAGLE-2). A tree's nodes are drafted node by node: the layer runs again at
every node that has children, on that node's own path, so each branch gets its own children's
distribution (a head-per-depth family can only reuse one distribution per depth). Its queries
see the committed slots, then their ancestors' entries and their own, which stay beside the
cache; with a dynamic tree's budget only each depth's best nodes by path score run.

Training (`model.eagle_train_features`):
  * 'drafted' (the default): depth k reads the true token x_{t+k} and its own predicted feature
    f'^{k-1}, and attends exactly as in drafting (the depth-1 entries of earlier positions, then
    its own chain), all depths in one pass: EAGLE-3's "training-time test". It costs K layer
    passes per step; depth k's queries score T keys and k - 1 of their own chain
    (`transformer.attend_with_own`), not the K*T keys of a buffer mostly masked.
  * 'trunk': only depth 1 is trained, on the trunk's features (EAGLE-1); head k's output at t is
    depth 1's at t+k-1. (So head k's accuracy is depth 1's at shifted positions: with this
    mode every head reports about the same accuracy.)
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

EAGLE-3 (`eagle_features='fused'` with `eagle_input='concat'`, three fused layers): vLLM's
EAGLE-3 checkpoint for Llama (`Eagle3LlamaForCausalLM`, `llama_eagle3.py`, for
`speculative_config={"method": "eagle3"}`) in the export's `eagle3/` directory, the layout of the
published EAGLE-3 drafters (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
  * config.json: a one-layer Llama config with `architectures: ["LlamaForCausalLMEagle3"]`,
    `draft_vocab_size` V (the whole vocabulary: no d2t/t2d, which vLLM then maps as the
    identity), `target_hidden_size` D, `eagle_aux_hidden_state_layer_ids` (the fused layers:
    vLLM's id i is the residual stream entering layer i, as here) and `num_speculative_tokens`;
  * `fc.weight` [D, 3D] (our `fuse`, its input [u^low; u^mid; u^high] in layer order, as vLLM
    concatenates), `midlayer.input_layernorm.weight` (on the embedding),
    `midlayer.hidden_norm.weight`, `midlayer.self_attn.{q,k,v}_proj.weight` [., 2D],
    `midlayer.self_attn.o_proj.weight`, `midlayer.post_attention_layernorm.weight`,
    `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [V, D] (vLLM's
    EAGLE-3 reads its own: a copy of the trunk's output layer) and `embed_tokens.weight` (a copy
    of the trunk's, as for EAGLE-1);
  * heads trained on a draft vocabulary of N ids (`mtp_head_draft_vocab`): `lm_head.weight` is
    those N rows [N, D], `draft_vocab_size` N, `d2t` [N] int64 the offsets from draft index to
    token id (id = index + d2t[index], vLLM's mapping) and `t2d` [V] bool the ids drafted.
Other option combinations have no vLLM layout and are refused (`hf_export`).
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
from mtp.model.heads import sequential
from mtp.model.heads import tree_drafts

Array = jax.Array

TRAIN_FEATURES = ('drafted', 'trunk')
FEATURES = ('last', 'fused')
INPUTS = ('fc', 'concat')
# The options that make this family EAGLE-3's drafter (train it with
# eagle_feature_loss_weight=0, as configs/smollm2_eagle3.py does).
EAGLE3 = {'eagle_features': 'fused', 'eagle_input': 'concat'}
SUBDIRECTORY = 'eagle'
SUBDIRECTORY_EAGLE3 = 'eagle3'
# EAGLE-3's layer: our names -> Hugging Face names under `midlayer.` (beside `_LAYER_NAMES`).
_EAGLE3_NORMS = {'input_norm': 'input_layernorm.weight', 'hidden_norm': 'hidden_norm.weight',
                 'mlp_norm': 'post_attention_layernorm.weight'}
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


def _linear(cfg: transformer.TransformerConfig, in_features: int, out_features: int,
            axes: tuple[str, str], *, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free projection initialised for unit-scale inputs (normal(in^-1/2))."""
  return nnx.Linear(
      in_features, out_features, use_bias=False, dtype=transformer.dtype_of(cfg.dtype),
      param_dtype=transformer.dtype_of(cfg.param_dtype), dot_general=products.dot_general,
      kernel_init=transformer.partitioned(nnx.initializers.normal(in_features ** -0.5), *axes),
      rngs=rngs)


class EagleLayer(nnx.Module):
  """A Llama decoder layer without its input norm: x + attn(x), then + mlp(norm(x))."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    self.attn = transformer.Attention(cfg, rngs=rngs)
    self.mlp_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.mlp = transformer.MLP(cfg, rngs=rngs)

  def __call__(self, x: Array, positions: Array, mask: Array, cache=None, lengths=None,
               ancestors=None):
    """x [B, T, D] -> (x [B, T, D], updated (keys, values) or None); see `Attention` (and
    for `ancestors`, tree drafting)."""
    attended, cache = self.attn(x, positions, mask, cache, lengths, ancestors)
    x = x + attended
    return x + self.mlp(self.mlp_norm(x)), cache


class Eagle3Layer(nnx.Module):
  """EAGLE-3's decoder layer: attention over [input_norm(e); hidden_norm(f)] (2D wide), the
  feature f as its residual, then + mlp(mlp_norm(.)) (see the module docstring)."""

  def __init__(self, cfg: transformer.TransformerConfig, *, rngs: nnx.Rngs):
    d, hd = cfg.embed_dim, cfg.head_dim
    self.input_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.hidden_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.attn = transformer.Attention(cfg, rngs=rngs)
    # The queries, keys and values read both halves: [2D] -> ... (o_proj stays [.] -> [D]).
    self.attn.q_proj = _linear(cfg, 2 * d, cfg.num_attention_heads * hd, ('embed', 'heads'),
                               rngs=rngs)
    self.attn.k_proj = _linear(cfg, 2 * d, cfg.num_kv_heads * hd, ('embed', 'kv_heads'),
                               rngs=rngs)
    self.attn.v_proj = _linear(cfg, 2 * d, cfg.num_kv_heads * hd, ('embed', 'kv_heads'),
                               rngs=rngs)
    self.mlp_norm = transformer.rms_norm(cfg, rngs=rngs)
    self.mlp = transformer.MLP(cfg, rngs=rngs)

  def __call__(self, x: Array, positions: Array, mask: Array, cache=None, lengths=None,
               ancestors=None):
    """x [B, T, 2D] = [embedding; feature] -> (h [B, T, D] before any norm, updated (keys,
    values) or None); see `Attention` (and for `ancestors`, tree drafting). One input, so
    `transformer.call_block` remats it."""
    embeds, features = jnp.split(x, 2, axis=-1)
    attended, cache = self.attn(
        jnp.concatenate([self.input_norm(embeds), self.hidden_norm(features)], axis=-1),
        positions, mask, cache, lengths, ancestors)
    h = features + attended
    return h + self.mlp(self.mlp_norm(h)), cache


def shift_left(x: Array, shift: int) -> Array:
  """x [B, T, ...] -> x[:, t + shift] at t, zeros past the end."""
  if not shift:
    return x
  t = x.shape[1]
  pad = [(0, 0), (0, min(shift, t))] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, shift:], pad)[:, :t]


def _choice(options: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str:
  value = options[key]
  if value not in allowed:
    raise ValueError(f'model.{key} must be one of {", ".join(allowed)}, got {value!r}.')
  return value


def _parse_layers(spec: Any) -> tuple[int, ...]:
  """`model.eagle_fused_layers`: '' (the default layers) -> (); 'i,j,k' -> (i, j, k), strictly
  increasing (the order the trunk passes them, and vLLM's). A string, not a list: it survives
  config.json and stays hashable in the model's static config."""
  if not isinstance(spec, str):
    raise ValueError(f"model.eagle_fused_layers must be a string of trunk layer indices such as "
                     f"'2,8,13' ('' for EAGLE-3's 2, L//2, L-3), got {spec!r}.")
  if not spec.strip():
    return ()
  try:
    layers = tuple(int(part) for part in spec.split(','))
  except ValueError:
    raise ValueError(f"model.eagle_fused_layers must be comma-separated integers such as "
                     f"'2,8,13', got {spec!r}.") from None
  if any(i < 0 for i in layers) or any(b <= a for a, b in zip(layers, layers[1:])):
    raise ValueError(f'model.eagle_fused_layers must be distinct layer indices >= 0 in '
                     f'increasing order, got {spec!r}.')
  return layers


def fused_layers(trunk_cfg: transformer.TransformerConfig,
                 options: Mapping[str, Any]) -> tuple[int, ...]:
  """The trunk layers whose inputs the fused feature reads, increasing (see the module
  docstring): `model.eagle_fused_layers`, or EAGLE-3's 2, L//2, L-3 clamped into [0, L-1]
  with repeats dropped. ValueError naming the option for layers the trunk lacks."""
  n = trunk_cfg.num_layers
  layers = _parse_layers(options['eagle_fused_layers'])
  if not layers:
    return tuple(sorted({min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)}))
  if layers[-1] >= n:
    raise ValueError(f'model.eagle_fused_layers names trunk layers {list(layers)}; the trunk '
                     f'has layers 0..{n - 1} (model.num_layers).')
  return layers


class EagleDrafter(heads.HeadFamily):
  """One EAGLE layer (`layers[0]`) drafting K tokens, with its input projection `fc` (EAGLE-1)
  or EAGLE-3's input layer and final `norm`, and EAGLE-3's feature fusion `fuse` when fused."""
  OPTIONS = {
      # Weight of the smooth-L1 feature regression (drafter vs trunk features) beside the heads'
      # token loss. EAGLE's 1.0 against 0.1 for the tokens would be 10 here; 1 measured best of
      # 0, 1 and 10 (benchmarks/drafters.py, see the module docstring). EAGLE-3 uses 0.
      'eagle_feature_loss_weight': 1.0,
      # What depths >= 2 read in training: their own predicted features ('drafted', as in
      # drafting) or the trunk's ('trunk': depth 1 alone is trained, EAGLE-1; cheaper, and
      # measured as good at depths 1-2, a little worse deeper).
      'eagle_train_features': 'drafted',
      # What depth 1 reads as the feature: the trunk's last hidden state after its final norm
      # ('last', EAGLE-1) or EAGLE-3's fusion of several trunk layers' inputs ('fused').
      'eagle_features': 'last',
      # With 'fused': the trunk layers whose inputs are fused, as 'i,j,k' (increasing); ''
      # takes EAGLE-3's 2, L//2, L-3 (clamped into the trunk, repeats dropped).
      'eagle_fused_layers': '',
      # How the layer reads [embedding; feature]: through fc [2D] -> [D] into a layer without
      # input norm ('fc', EAGLE-1), or EAGLE-3's layer, whose q/k/v read the normed 2D
      # concatenation, with the drafter's own final norm before the output layer ('concat').
      'eagle_input': 'fc',
  }

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    d = trunk_cfg.embed_dim
    self.num_heads = num_heads
    self.train_features = options['eagle_train_features']
    self.features = options['eagle_features']
    self.input = options['eagle_input']
    self.loss_weight = float(options['eagle_feature_loss_weight'])
    if self.input == 'fc':  # EAGLE-1's parameters, created in EAGLE-1's order.
      self.fc = _linear(trunk_cfg, 2 * d, d, ('mlp', 'embed'), rngs=rngs)
      self.layers = nnx.List([EagleLayer(trunk_cfg, rngs=rngs)])
    else:
      self.layers = nnx.List([Eagle3Layer(trunk_cfg, rngs=rngs)])
      self.norm = transformer.rms_norm(trunk_cfg, rngs=rngs)
    self.fused_layers = ()
    if self.features == 'fused':
      self.fused_layers = fused_layers(trunk_cfg, options)
      self.fuse = _linear(trunk_cfg, len(self.fused_layers) * d, d, ('mlp', 'embed'), rngs=rngs)

  @classmethod
  def validate_options(cls, options: Mapping[str, Any]) -> None:
    _choice(options, 'eagle_train_features', TRAIN_FEATURES)
    features = _choice(options, 'eagle_features', FEATURES)
    _choice(options, 'eagle_input', INPUTS)
    weight = options['eagle_feature_loss_weight']
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
        or not np.isfinite(weight) or weight < 0):
      raise ValueError(f'model.eagle_feature_loss_weight must be a finite number >= 0, got '
                       f'{weight!r}.')
    if _parse_layers(options['eagle_fused_layers']) and features != 'fused':
      raise ValueError("model.eagle_fused_layers applies with model.eagle_features='fused' "
                       f'only; it is {features!r}.')

  @classmethod
  def trunk_layer_inputs(cls, trunk_cfg, num_heads, options) -> tuple[int, ...]:
    """The fused layers' inputs with `eagle_features='fused'`, else none."""
    del num_heads
    if options['eagle_features'] != 'fused':
      return ()
    return fused_layers(trunk_cfg, options)

  @property
  def num_cache_layers(self) -> int:
    return 1

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    """The fusion [n*D] -> [D] once; per depth, the input projection [2D] -> [D] ('fc') or the
    2D-wide q/k/v ('concat') and the layer, run once per depth (K times, each depth attending
    to the earlier depths' keys too), or once with `eagle_train_features='trunk'`."""
    cfg, tokens = trunk_cfg, batch_size * seq_len
    d, hd = cfg.embed_dim, cfg.head_dim
    block = flops.block_matmul_flops(cfg, tokens)
    if options['eagle_input'] == 'fc':
      projection = sequential.projection_flops(cfg, tokens)
    else:  # No fc; q/k/v read 2D instead of D (part of the layer, so remat recomputes it).
      projection = 0.0
      block += 2.0 * d * (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * hd * tokens
    fuse = 0.0
    if options['eagle_features'] == 'fused':
      fuse = 2.0 * len(fused_layers(cfg, options)) * d * d * tokens
    if options['eagle_train_features'] == 'trunk':  # Depth 1 only, then shifted.
      attention = flops.attention_flops(cfg, batch_size, seq_len, count)
      return flops.HeadFlops(fuse + projection + block, attention, block + attention)
    # Every depth runs the shared layer over all T positions. Depth d's queries attend to depth
    # 1's keys causally and to the d - 1 keys of their own chain (`attend_with_own`).
    k = num_heads
    per_depth = [flops.attention_flops(cfg, batch_size, seq_len, count) +
                 4.0 * batch_size * cfg.num_attention_heads * hd * seq_len * (depth - 1)
                 for depth in range(1, k + 1)]
    return flops.HeadFlops(fuse + k * (projection + block), sum(per_depth),
                           0.0)  # Not rematerialised.

  @property
  def feature_loss_weight(self) -> float:
    return self.loss_weight

  def _first_features(self, normed: Array, layer_inputs: Mapping[int, Array] | None) -> Array:
    """What depth 1 reads as the feature, [B, T, D]: the trunk's normed last state, or
    `fuse` over the concatenated inputs {i: [B, T, D]} of the fused layers."""
    if self.features == 'last':
      return normed
    return self.fuse(jnp.concatenate([layer_inputs[i] for i in self.fused_layers], axis=-1))

  def _input(self, embeds: Array, features: Array) -> Array:
    """The layer's input from embeddings and features, [B, T, D] each: fc([e; f]) [B, T, D],
    or with EAGLE-3's layer [e; f] [B, T, 2D] (the layer norms each half)."""
    x = jnp.concatenate([embeds.astype(features.dtype), features], axis=-1)
    return self.fc(x) if self.input == 'fc' else x

  def _output(self, h: Array) -> Array:
    """The layer's output [..., D] (what the next depth reads) -> what the output layer reads:
    itself (EAGLE-1 predicts the trunk's normed feature) or the drafter's norm (EAGLE-3)."""
    return h if self.input == 'fc' else self.norm(h)

  def __call__(self, trunk, hidden, normed, tokens, positions, mask, *,
               layer_inputs: Mapping[int, Array] | None = None) -> list[Array]:
    """K arrays [B, T, D] (the output layer's inputs); `layer_inputs` {i: [B, T, D]} are the
    fused layers' inputs (given with `eagle_features='fused'` only)."""
    layer, k = self.layers[0], self.num_heads
    next_embeds = sequential.shifted_embeddings(trunk.embed(tokens), k)
    features = self._first_features(normed, layer_inputs)
    if self.train_features == 'trunk':
      first, _ = transformer.call_block(layer, self._input(next_embeds[0], features), positions,
                                        mask, remat=trunk.cfg.remat != 'none')
      first = self._output(first)
      return [shift_left(first, depth) for depth in range(k)]
    # Depth 1 attends causally to its own keys; depth k >= 2 to depth 1's (as `mask` allows),
    # then to its chain's at t: depths 2..k-1's and its own (`transformer.attend_with_own`).
    b, t = tokens.shape
    cfg = trunk.cfg
    dtype = transformer.dtype_of(cfg.dtype)
    shape = (b, cfg.num_kv_heads, t, cfg.head_dim)  # A cache layer's layout (`kv_cache`).
    first_keys = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    chain = (jnp.zeros((b, t, 0, cfg.num_kv_heads, cfg.head_dim), dtype),) * 2
    outputs = []
    for depth in range(1, k + 1):
      x = self._input(next_embeds[depth - 1], features)
      if depth == 1:
        features, first_keys = layer(x, positions, mask, first_keys, jnp.zeros((b,), jnp.int32))
      else:
        features, new = layer(x, positions + depth - 1, mask, first_keys, ancestors=chain)
        chain = tuple(jnp.concatenate([c, n[:, :, None]], axis=2) for c, n in zip(chain, new))
      outputs.append(self._output(features))
    return outputs

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer, *,
             trunk=None, layer_inputs=None):
    """Features [B, T, D]: the trunk's normed states, or the fused ones (the trunk passes the
    fused layers' inputs, and itself, only then). The drafter writes its cache in `draft`."""
    del hidden, positions, block_mask, lengths, first_layer, trunk
    return self._first_features(normed, layer_inputs), cache

  def _draft_root(self, trunk, features, tokens, last_index, cache, lengths, first_layer):
    """Depth 1 over the accepted run: (the feature h [B, D] at the last accepted token, the
    drafter's cache layer with the run's entries written)."""
    t = features.shape[1]
    # Slot s reads f_s and x_{s+1} (scratch past last_index + 1, and overwritten by the deeper
    # depths or the next draft).
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    x = self._input(trunk.embed(tokens[:, 1:1 + t]), features)
    h, layer_cache = self.layers[0](x, positions, heads.causal_mask(t),
                                    heads.layer_cache(cache, first_layer), lengths)
    return kv_cache_lib.gather_rows(h, last_index), layer_cache

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer,
            vocab=None):
    project = heads.DraftProjection(trunk, vocab)
    layer = self.layers[0]
    feature, layer_cache = self._draft_root(trunk, features, tokens, last_index, cache, lengths,
                                            first_layer)
    logits = [project.logits(self._output(feature))]
    slot = lengths + last_index
    for _ in range(1, depth):
      # One new entry per row, right after the previous one; a row at the cache's end writes
      # into its last slot, which no committed token uses (it has finished anyway).
      slot = slot + 1
      drafted = project.token_ids(argmax_lib.argmax(logits[-1])).astype(tokens.dtype)
      x = self._input(trunk.embed(drafted[:, None]), feature[:, None])
      h, layer_cache = layer(x, slot[:, None], heads.causal_mask(1), layer_cache, slot)
      feature = h[:, 0]
      logits.append(project.logits(self._output(feature)))
    return jnp.stack(logits), transformer.replace_layers(cache, first_layer, [layer_cache])

  def draft_tree(self, trunk, features, tokens, last_index, cache, lengths, tree, first_layer,
                 vocab=None, mask=None, budget=None):
    """EAGLE-2's tree drafting: each expanded node's children come from the drafter run at
    that node, on its own path.

    Depth by depth, the layer runs once over the nodes of the depth that have children: node
    n at depth d reads [embed(token_n); h_parent(n)] at position root + d and attends to the
    committed slots (the run's, through the root) and then to its own ancestors' entries and
    its own, kept beside the cache (`Attention`'s `ancestors`), so nothing is written past the
    run. With a `budget` (EAGLE-2's beam), only each row's best budget - 1 of them by score
    are expanded: a node outside them is outside the best budget - 1 of all nodes, and so are
    its descendants (they score less), so the best budget nodes are those of expanding every
    node. A chain is the top-1 path of `draft`, which it uses.
    """
    if tree.is_chain:
      return super().draft_tree(trunk, features, tokens, last_index, cache, lengths, tree,
                                first_layer, vocab=vocab, mask=mask)
    project = heads.DraftProjection(trunk, vocab)
    mask = mask or (lambda logits: logits)
    layer = self.layers[0]
    root, layer_cache = self._draft_root(trunk, features, tokens, last_index, cache, lengths,
                                         first_layer)
    b, m = root.shape[0], tree.num_nodes
    rows = jnp.arange(b)[:, None]
    drafts = tree_drafts.assign_children(
        tree, tree_drafts.empty(tree, b), np.zeros(1, np.int32),
        mask(project.logits(self._output(root)))[:, None], project.token_ids)
    # Every expanded node's output and its own (rotated) key and value, by node index.
    hidden = jnp.zeros((b, m) + root.shape[1:], root.dtype).at[:, 0].set(root)
    entries = None
    committed = lengths + last_index + 1  # The slots through the root's.
    for d in range(1, tree.max_depth):
      candidates = tree_drafts.expanded_nodes(tree, d)
      width = min(len(candidates), budget - 1 if budget else len(candidates))
      if not width:
        continue
      if width < len(candidates):  # Each row's best `width` by score.
        best = jax.lax.top_k(drafts.scores[:, candidates], width)[1]
        nodes = jnp.asarray(candidates, jnp.int32)[best]  # [B, W]
      else:
        nodes = jnp.broadcast_to(jnp.asarray(candidates, jnp.int32), (b, width))
      parent = jnp.asarray(tree.parent)[nodes]
      x = self._input(trunk.embed(jnp.take_along_axis(drafts.tokens, nodes, axis=1)),
                      hidden[rows, parent])
      if entries is None:
        _, g, _, head_dim = layer_cache[0].shape
        kv_shape = (b, width, 0, g, head_dim)
        ancestors = (jnp.zeros(kv_shape, layer_cache[0].dtype),) * 2
      else:  # [B, W, d - 1, G, H]: the entries of each node's ancestors below the root.
        path = jnp.asarray(tree.node_paths)[nodes][:, :, 1:d]
        ancestors = tuple(e[rows[:, :, None], path] for e in entries)
      positions = jnp.broadcast_to((committed + d - 1)[:, None], (b, width))
      h, new = layer(x, positions, None, layer_cache, committed, ancestors=ancestors)
      if entries is None:
        entries = tuple(jnp.zeros((b, m) + e.shape[2:], e.dtype) for e in new)
      entries = tuple(e.at[rows, nodes].set(n.astype(e.dtype)) for e, n in zip(entries, new))
      hidden = hidden.at[rows, nodes].set(h)
      drafts = tree_drafts.assign_children(tree, drafts, nodes,
                                           mask(project.logits(self._output(h))),
                                           project.token_ids)
    return drafts, transformer.replace_layers(cache, first_layer, [layer_cache])

  def hf_export(self, context: heads.HFExportContext) -> heads.HFExport:
    """vLLM's EAGLE-1 Llama drafter in `eagle/`, or its EAGLE-3 one in `eagle3/` (see the
    module docstring); NotImplementedError for option combinations vLLM has no layout for."""
    if (self.features, self.input) == ('fused', 'concat') and len(self.fused_layers) == 3:
      return self._hf_export_eagle3(context)
    if (self.features, self.input) != ('last', 'fc'):
      raise NotImplementedError(
          f"vLLM has a layout for EAGLE-1 (model.eagle_features='last', "
          f"model.eagle_input='fc') and for EAGLE-3 (eagle_features='fused' over three layers, "
          f"eagle_input='concat') only; this drafter has eagle_features={self.features!r}"
          f"{f' over layers {list(self.fused_layers)}' if self.fused_layers else ''}, "
          f"eagle_input={self.input!r}, which the hf export cannot write: export with "
          f"--format=params or jax_export.")
    cfg = context.trunk_cfg
    layer = self.layers[0]
    tensors = {'fc.weight': heads.as_numpy(self.fc.kernel).T,
               'embed_tokens.weight': context.embedding,
               f'layers.0.{_MLP_NORM}': heads.as_numpy(layer.mlp_norm.scale)}
    for (part, name), hf_name in _LAYER_NAMES.items():
      tensors[f'layers.0.{hf_name}'] = heads.as_numpy(getattr(getattr(layer, part), name).kernel).T
    config = {**_llama_config(cfg), 'architectures': ['LlamaForCausalLM'],
              'num_speculative_tokens': self.num_heads}
    return heads.HFExport(format='vllm-eagle',
                          subdirectories={SUBDIRECTORY: heads.HFSubdirectory(config, tensors)})

  def _hf_export_eagle3(self, context: heads.HFExportContext) -> heads.HFExport:
    """vLLM's EAGLE-3 Llama drafter in `eagle3/` (see the module docstring)."""
    cfg = context.trunk_cfg
    layer = self.layers[0]
    lm_head, draft_vocab_size = context.unembedding, cfg.vocab_size
    tensors = {'fc.weight': heads.as_numpy(self.fuse.kernel).T,
               'norm.weight': heads.as_numpy(self.norm.scale),
               'embed_tokens.weight': context.embedding}
    if context.draft_ids is not None:
      # Draft index i is token ids[i] = i + d2t[i]; t2d marks the ids drafted (EAGLE-3's pair).
      ids = np.asarray(context.draft_ids, np.int64)
      lm_head, draft_vocab_size = context.unembedding[ids], ids.shape[0]
      tensors['d2t'] = ids - np.arange(ids.shape[0], dtype=np.int64)
      tensors['t2d'] = np.isin(np.arange(cfg.vocab_size), ids)
    tensors['lm_head.weight'] = lm_head
    for name, hf_name in _EAGLE3_NORMS.items():
      tensors[f'midlayer.{hf_name}'] = heads.as_numpy(getattr(layer, name).scale)
    for (part, name), hf_name in _LAYER_NAMES.items():
      tensors[f'midlayer.{hf_name}'] = heads.as_numpy(getattr(getattr(layer, part),
                                                              name).kernel).T
    config = {**_llama_config(cfg), 'architectures': ['LlamaForCausalLMEagle3'],
              'tie_word_embeddings': False, 'draft_vocab_size': draft_vocab_size,
              'target_hidden_size': cfg.embed_dim,
              'eagle_aux_hidden_state_layer_ids': list(self.fused_layers),
              'num_speculative_tokens': self.num_heads}
    return heads.HFExport(format='vllm-eagle3', subdirectories={
        SUBDIRECTORY_EAGLE3: heads.HFSubdirectory(config, tensors)})

  @classmethod
  def hf_import(cls, source: heads.HFImportSource) -> heads.HFImport | None:
    """`eagle/` in vLLM's EAGLE-1 format or `eagle3/` in its EAGLE-3 one, `hf_export`'s
    inverse. K is `num_speculative_tokens` (1 when absent: a published drafter does not say);
    copies of the embedding (and, for EAGLE-3, of the output layer) must be the base
    model's."""
    eagle1 = source.subdirectory(SUBDIRECTORY)
    eagle3 = source.subdirectory(SUBDIRECTORY_EAGLE3)
    if eagle1 is not None and eagle3 is not None:
      raise ValueError(f'both {SUBDIRECTORY}/ and {SUBDIRECTORY_EAGLE3}/ hold an EAGLE drafter; '
                       'an mtp model has one.')
    if eagle3 is not None:
      return _hf_import_eagle3(source, eagle3)
    return None if eagle1 is None else _hf_import_eagle1(source, eagle1)


def _llama_config(cfg: transformer.TransformerConfig) -> dict[str, Any]:
  """A one-layer Llama config.json of the trunk's shape (the drafter's layer)."""
  return {
      'model_type': 'llama', 'vocab_size': cfg.vocab_size, 'hidden_size': cfg.embed_dim,
      'intermediate_size': cfg.mlp_dim, 'num_hidden_layers': 1,
      'num_attention_heads': cfg.num_attention_heads, 'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim, 'max_position_embeddings': cfg.max_seq_len,
      'rms_norm_eps': cfg.norm_eps, 'hidden_act': 'silu', 'attention_bias': False,
      'mlp_bias': False, 'tie_word_embeddings': cfg.tie_embeddings,
      'rope_theta': cfg.rope_theta, 'rope_scaling': None,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
  }


def _check_one_layer(sub: heads.HFSubdirectory, where: str) -> None:
  if int(sub.config.get('num_hidden_layers', 1)) != 1:
    raise ValueError(f'{where}config.json has num_hidden_layers '
                     f'{sub.config["num_hidden_layers"]}; mtp\'s EAGLE drafter has one layer.')


def _check_shape(array: np.ndarray, name: str, shape: tuple[int, ...], where: str) -> None:
  if array.shape != shape:
    raise ValueError(f'{where}{name} has shape {list(array.shape)}, expected {list(shape)} for '
                     'the base model.')


def _hf_import_eagle1(source: heads.HFImportSource,
                      sub: heads.HFSubdirectory) -> heads.HFImport:
  """`eagle/`: `fc.bias` and `input_layernorm` are refused (vLLM's EAGLE-1 Llama has
  neither)."""
  where = f'{SUBDIRECTORY}/: '
  cfg = source.trunk_cfg
  _check_one_layer(sub, where)
  for name in ('fc.bias', 'layers.0.input_layernorm.weight'):
    if name in sub.tensors:
      raise ValueError(f'{where}{name} is not part of vLLM\'s EAGLE-1 Llama drafter; this '
                       'drafter cannot be imported.')
  t = sub.tensors
  fc = heads.take(t, 'fc.weight', where)
  _check_shape(fc, 'fc.weight', (cfg.embed_dim, 2 * cfg.embed_dim), where)
  heads.check_shared(t, 'embed_tokens.weight', source.embedding, 'embedding', where)
  layer: dict[str, Any] = {'attn': {}, 'mlp': {},
                           'mlp_norm': {'scale': heads.take(t, f'layers.0.{_MLP_NORM}', where)}}
  for (part, name), hf_name in _LAYER_NAMES.items():
    layer[part][name] = {'kernel': heads.take(t, f'layers.0.{hf_name}', where).T}
  num_heads = int(sub.config.get('num_speculative_tokens') or 1)
  return heads.HFImport(num_heads=num_heads, options={},
                        params={'fc': {'kernel': fc.T}, 'layers': {0: layer}})


def _hf_import_eagle3(source: heads.HFImportSource,
                      sub: heads.HFSubdirectory) -> heads.HFImport:
  """`eagle3/`: the layer's tensors under `midlayer.` (or vLLM's own `layers.0.`); the fused
  layers are `eagle_aux_hidden_state_layer_ids` (vLLM's 2, L//2, L-3 when absent). A draft
  vocabulary (`draft_vocab_size` N, `d2t`) is imported as the heads' (`mtp_head_draft_vocab`)
  when `lm_head` holds the base model's output rows of its ids. Refused: biases and
  `norm_before_residual`."""
  where = f'{SUBDIRECTORY_EAGLE3}/: '
  cfg, config, t = source.trunk_cfg, sub.config, sub.tensors
  d, n = cfg.embed_dim, cfg.num_layers
  _check_one_layer(sub, where)
  if config.get('norm_before_residual'):
    raise ValueError(f'{where}config.json sets norm_before_residual; mtp\'s EAGLE-3 layer adds '
                     'the feature before hidden_norm (vLLM\'s default).')
  draft_ids = _imported_draft_ids(sub, cfg.vocab_size, where)
  biases = sorted(name for name in t if name.endswith('.bias'))
  if biases:
    raise ValueError(f'{where}{biases[0]} is not part of mtp\'s EAGLE-3 drafter (no biases).')
  prefix = 'midlayer.' if any(name.startswith('midlayer.') for name in t) else 'layers.0.'
  layers = tuple(int(i) for i in config.get('eagle_aux_hidden_state_layer_ids')
                 or (2, n // 2, n - 3))
  if len(layers) != 3 or any(not 0 <= i < n for i in layers) or list(layers) != sorted(
      set(layers)):
    raise ValueError(f'{where}eagle_aux_hidden_state_layer_ids {list(layers)} are not three '
                     f'increasing layers of the base model (0..{n - 1}).')
  fc = heads.take(t, 'fc.weight', where)
  _check_shape(fc, 'fc.weight', (d, 3 * d), where)
  heads.check_shared(t, 'embed_tokens.weight', source.embedding, 'embedding', where)
  heads.check_shared(t, 'lm_head.weight', source.unembedding if draft_ids is None
                     else source.unembedding[draft_ids], 'output layer', where)
  layer: dict[str, Any] = {'attn': {}, 'mlp': {}}
  for name, hf_name in _EAGLE3_NORMS.items():
    layer[name] = {'scale': heads.take(t, prefix + hf_name, where)}
  for (part, name), hf_name in _LAYER_NAMES.items():
    layer[part][name] = {'kernel': heads.take(t, prefix + hf_name, where).T}
  _check_shape(layer['attn']['q_proj']['kernel'], f'{prefix}self_attn.q_proj.weight (transposed)',
               (2 * d, cfg.num_attention_heads * cfg.head_dim), where)
  default = fused_layers(cfg, {'eagle_fused_layers': ''})
  options = {'eagle_features': 'fused', 'eagle_input': 'concat',
             'eagle_fused_layers': '' if layers == default else ','.join(map(str, layers)),
             'eagle_feature_loss_weight': 0.0}  # EAGLE-3 trains without it.
  num_heads = int(config.get('num_speculative_tokens') or 1)
  return heads.HFImport(num_heads=num_heads, options=options, draft_ids=draft_ids, params={
      'fuse': {'kernel': fc.T}, 'norm': {'scale': heads.take(t, 'norm.weight', where)},
      'layers': {0: layer}})


def _imported_draft_ids(sub: heads.HFSubdirectory, vocab_size: int,
                        where: str) -> np.ndarray | None:
  """[N] int32 ids of an EAGLE-3 drafter's draft vocabulary (draft index i is token
  i + d2t[i], vLLM's mapping), or None when it drafts over the whole vocabulary."""
  size = int(sub.config.get('draft_vocab_size') or vocab_size)
  d2t = sub.tensors.get('d2t')
  if d2t is None:
    if size != vocab_size:
      raise ValueError(f'{where}draft_vocab_size is {size}, not the vocabulary\'s {vocab_size}, '
                       'but there is no d2t tensor to map draft indices to token ids.')
    return None
  d2t = np.asarray(d2t)
  if d2t.shape != (size,) or not np.issubdtype(d2t.dtype, np.integer):
    raise ValueError(f'{where}d2t must be [{size}] integers (draft_vocab_size), got '
                     f'{d2t.dtype} {d2t.shape}.')
  ids = np.arange(size, dtype=np.int64) + d2t
  if ids.min() < 0 or ids.max() >= vocab_size or np.unique(ids).size != size:
    raise ValueError(f'{where}d2t maps draft indices to ids outside [0, {vocab_size}) or to '
                     'one id twice.')
  t2d = sub.tensors.get('t2d')
  if t2d is not None and not np.array_equal(np.asarray(t2d, bool),
                                            np.isin(np.arange(vocab_size), ids)):
    raise ValueError(f'{where}t2d does not mark the ids d2t drafts.')
  if size == vocab_size and not np.any(d2t):
    return None
  return ids.astype(np.int32)
