"""Llama-style trunk: embedding, RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Two ways in:
  * training: a packed batch, causal attention restricted to each row's documents
    (`segment_ids`), no cache;
  * cached: T new tokens per row written into a `KVCache` at each row's own committed length,
    attending to the committed prefix and, inside the new block, to what `block_mask` allows
    (lower-triangular for a chain; ancestors-only for a candidate tree).

Parameters carry logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'norm') that
`mtp.parallel.mesh` maps onto the device mesh.

Two layouts of the layers (`scan_layers`, see `mtp.model.layout`): a list of blocks run by a Python
loop (unrolled: every program holds L copies of the layer), or one block whose parameters carry a
leading 'layers' axis [L, ...], run by `jax.lax.scan` in training (compiled once, whatever L;
the scanned body is where a remat policy applies) and layer by layer on the KV cache. Both
layouts compute the same function of the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.model import kv_cache as kv_cache_lib
from mtp.model import products
from mtp.parallel import mesh as mesh_lib

Array = jax.Array
# What the backward pass recomputes (training only): 'none'; 'heads' (the MTP heads' layers);
# 'full' (trunk blocks too, keeping only each block's input); 'dots_saveable' (trunk blocks keep
# their matmul outputs and recompute the rest; heads as 'heads').
REMAT_POLICIES = ('none', 'heads', 'full', 'dots_saveable')
# jax.checkpoint policies of the trunk's blocks per `remat` (absent: the trunk is not remat'ed).
_TRUNK_CHECKPOINT_POLICIES = {
    'full': None,  # Save nothing but the block's input.
    'dots_saveable': products.SAVE_DOTS,
}


def partitioned(init, *axes: str | None):
  """An initializer whose parameter carries logical axis names (sharded later, not eagerly)."""
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def dtype_of(name: str | Any):
  return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shape of the trunk. Built from `config.model` by `from_config`."""
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_attention_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  # Recompute activations in the backward pass instead of keeping them (training only): one of
  # REMAT_POLICIES.
  remat: str = 'none'
  # The layers stacked on a leading 'layers' axis and run with jax.lax.scan (`mtp.model.layout`).
  scan_layers: bool = False

  @classmethod
  def from_config(cls, model_config) -> 'TransformerConfig':
    """From `config.model`; also reads the legacy key `num_heads` (attention heads)."""
    model_config = dict(model_config)
    if 'num_heads' in model_config and 'num_attention_heads' not in model_config:
      model_config['num_attention_heads'] = model_config['num_heads']
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in model_config.items() if k in names})

  def validate(self) -> None:
    for name in ('vocab_size', 'embed_dim', 'num_layers', 'num_attention_heads', 'num_kv_heads',
                 'head_dim', 'mlp_dim', 'max_seq_len'):
      if getattr(self, name) <= 0:
        raise ValueError(f'model.{name} must be positive, got {getattr(self, name)}.')
    if self.num_attention_heads % self.num_kv_heads:
      raise ValueError(f'model.num_attention_heads ({self.num_attention_heads}) must be a '
                       f'multiple of '
                       f'model.num_kv_heads ({self.num_kv_heads}).')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'model.remat must be one of {", ".join(REMAT_POLICIES)}, got '
                       f'{self.remat!r}.')
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f'model.scan_layers must be true or false, got {self.scan_layers!r}.')
    if self.head_dim % 2:
      raise ValueError(f'model.head_dim must be even for rotary embeddings, got {self.head_dim}.')


@functools.lru_cache(maxsize=None)
def _inverse_frequencies(theta: float, half: int) -> np.ndarray:
  """RoPE's [half] float32 frequencies theta^(-i / half), as a constant: computed by XLA inside
  a decoding loop they were hoisted out of it as one more loop-carried array per use (SmolLM2's
  loop: 184 of its 669)."""
  return (float(theta) ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)


def rotary_embedding(x: Array, positions: Array, theta: float) -> Array:
  """Rotates pairs of features by position-dependent angles (RoPE, half-split layout).

  Args:
    x: [B, T, Q, H] queries or [B, T, G, H] keys.
    positions: [B, T] integer positions.
  """
  half = x.shape[-1] // 2
  angles = positions[..., None].astype(jnp.float32) * _inverse_frequencies(theta, half)
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def training_mask(segment_ids: Array) -> Array:
  """[B, 1, T, T] causal mask that also stops attention across packed documents (id 0 = pad)."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same)[:, None]


def attend_with_own(q: Array, keys: Array, values: Array, mask: Array, own_keys: Array,
                    own_values: Array) -> Array:
  """Dense attention over a block's keys, as `mask` allows, and over keys of each query's own,
  always visible, in one softmax.

  EAGLE's training-time test: depth k's query at t sees depth 1's keys causally and its own
  chain's keys of depths 2..k at t. Attending to the chains as K*T more masked keys would cost
  K times the scores; these are E per query. Precision as `jax.nn.dot_product_attention`'s:
  scores and softmax in float32, products in the inputs' dtype.

  Args:
    q: [B, T, H, d] queries (rotated).
    keys, values: [B, G, S, d] (a cache's layout); G divides H.
    mask: [B, 1, T, S] which of them each query sees.
    own_keys, own_values: [B, T, E, G, d].

  Returns:
    [B, T, H, d] in q's dtype.
  """
  b, t, h, d = q.shape
  g, s = keys.shape[1], keys.shape[2]
  queries = q.reshape(b, t, g, h // g, d)
  precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
  einsum = lambda spec, x, y: jnp.einsum(spec, x, y, precision=precision,
                                         preferred_element_type=jnp.float32)
  scores = einsum('btgrd,bgsd->bgrts', queries, keys) * d ** -0.5
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
  own_scores = einsum('btgrd,btegd->bgrte', queries, own_keys) * d ** -0.5
  probs = jax.nn.softmax(jnp.concatenate([scores, own_scores], axis=-1), axis=-1)
  probs = probs.astype(values.dtype)
  out = (jnp.einsum('bgrts,bgsd->btgrd', probs[..., :s], values)
         + jnp.einsum('bgrte,btegd->btgrd', probs[..., s:], own_values))
  return out.reshape(b, t, h, d).astype(q.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary positions and an optional KV cache."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.embed_dim ** -0.5)
    out_init = nnx.initializers.normal((cfg.num_attention_heads * cfg.head_dim) ** -0.5
                                       / (2 * cfg.num_layers) ** 0.5)
    common = dict(use_bias=False, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
                  dot_general=products.dot_general, rngs=rngs)
    self.q_proj = nnx.Linear(cfg.embed_dim, cfg.num_attention_heads * cfg.head_dim,
                             kernel_init=partitioned(init, 'embed', 'heads'), **common)
    self.k_proj = nnx.Linear(cfg.embed_dim, cfg.num_kv_heads * cfg.head_dim,
                             kernel_init=partitioned(init, 'embed', 'kv_heads'), **common)
    self.v_proj = nnx.Linear(cfg.embed_dim, cfg.num_kv_heads * cfg.head_dim,
                             kernel_init=partitioned(init, 'embed', 'kv_heads'), **common)
    self.o_proj = nnx.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.embed_dim,
                             kernel_init=partitioned(out_init, 'heads', 'embed'), **common)

  def projections(self, x: Array) -> tuple[Array, Array, Array]:
    """x [..., D] -> the queries [..., Q·H], keys and values [..., G·H], before rotation."""
    fused = getattr(self, 'qkv_proj', None)  # A decoding copy's (`fused_projections`).
    if fused is None:
      return self.q_proj(x), self.k_proj(x), self.v_proj(x)
    cfg = self.cfg
    q_width = cfg.num_attention_heads * cfg.head_dim
    return tuple(jnp.split(fused(x), (q_width, q_width + cfg.num_kv_heads * cfg.head_dim), -1))

  def __call__(self, x: Array, positions: Array, mask: Array | None,
               cache: tuple[Array, Array] | None = None,
               lengths: Array | None = None,
               ancestors: tuple[Array, Array] | None = None
               ) -> tuple[Array, tuple[Array, Array] | None]:
    """Attends x [B, T, D] at `positions` [B, T].

    Without a cache, `mask` is [B, 1, T, T]. With `cache` = (keys, values), each [B, G, S, H],
    the new keys and values are written at slots `lengths` [B] onward, and `mask` is either
    the block mask, [T, T] or [B, T, T] (the cached path: every committed slot is visible, and
    inside the new block what the mask allows; `kv_cache.attend`, whose result does not depend
    on S), or a whole [B, 1, T, S] mask over the cache's slots. Returns the output [B, T, D]
    and the updated (keys, values) or None.

    With `ancestors` = (keys, values), each [B, T, A, G, H] (rotated), the cache is only read:
    query t sees the committed slots (< lengths), then A keys of its own and its own new key
    (tree drafting: a node's ancestors, kept outside the cache). `mask` is unused, and the
    second result is the new tokens' (keys, values) [B, T, G, H], not the cache. Without
    `lengths`, the cache is a block's keys and values [B, G, S, H] seen as the [B, 1, T, S]
    `mask` allows, besides the A + 1 keys of each query's own (EAGLE's training-time test:
    `attend_with_own`).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    q, k, v = self.projections(x)
    q = q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    q = rotary_embedding(q, positions, cfg.rope_theta)
    k = rotary_embedding(k, positions, cfg.rope_theta)
    if ancestors is not None:
      own = tuple(jnp.concatenate([a, new[:, :, None]], axis=2) for a, new in
                  zip(ancestors, (k, v)))
      if lengths is None:
        out = attend_with_own(q, cache[0], cache[1], mask, *own)
      else:
        out = kv_cache_lib.attend(q, cache[0], cache[1], lengths, jnp.zeros((t, 1), bool),
                                  own=own + (jnp.ones((t, own[0].shape[2]), bool),))
      return self.o_proj(out.reshape(b, t, cfg.num_attention_heads * cfg.head_dim)), (k, v)
    if cache is not None:
      keys = kv_cache_lib.write_slots(cache[0], k, lengths)
      values = kv_cache_lib.write_slots(cache[1], v, lengths)
      cache = (keys, values)
      if mask.ndim < 4:
        out = kv_cache_lib.attend(q, keys, values, lengths, mask, block=(k, v))
        return self.o_proj(out.reshape(b, t, cfg.num_attention_heads * cfg.head_dim)), cache
      k, v = (jnp.swapaxes(kv_cache_lib.loaded(c, q.dtype), 1, 2) for c in cache)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    return self.o_proj(out.reshape(b, t, cfg.num_attention_heads * cfg.head_dim)), cache


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.embed_dim ** -0.5)
    out_init = nnx.initializers.normal(cfg.mlp_dim ** -0.5 / (2 * cfg.num_layers) ** 0.5)
    common = dict(use_bias=False, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
                  dot_general=products.dot_general, rngs=rngs)
    self.gate = nnx.Linear(cfg.embed_dim, cfg.mlp_dim,
                           kernel_init=partitioned(init, 'embed', 'mlp'), **common)
    self.up = nnx.Linear(cfg.embed_dim, cfg.mlp_dim,
                         kernel_init=partitioned(init, 'embed', 'mlp'), **common)
    self.down = nnx.Linear(cfg.mlp_dim, cfg.embed_dim,
                           kernel_init=partitioned(out_init, 'mlp', 'embed'), **common)

  def __call__(self, x: Array) -> Array:
    fused = getattr(self, 'gate_up', None)  # A decoding copy's (`fused_projections`).
    if fused is None:
      return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
    gate, up = jnp.split(fused(x), 2, axis=-1)
    return self.down(jax.nn.silu(gate) * up)


class FusedLinear(nnx.Module):
  """Several bias-free `nnx.Linear`s of one input as one matmul: their kernels side by side."""

  def __init__(self, linears: Sequence[nnx.Linear]):
    self.dtype = linears[0].dtype
    self.kernel = nnx.Param(jnp.concatenate([l.kernel[...] for l in linears], axis=-1))

  def __call__(self, x: Array) -> Array:
    x, kernel = nnx.nn.dtypes.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
    return products.einsum('...d,...df->...f', x, kernel)


def fused_projections(model: nnx.Module) -> nnx.Module:
  """A copy of `model` for decoding: each attention's q, k and v projections as one matmul,
  each MLP's gate and up projections as another.

  Decoding reads every weight once per step for a few tokens, and on CPU three small matmuls
  cost more than one of their combined width (SmolLM2's shapes at batch 1, one token: the
  layers' matmuls 12% faster fused). The copy shares every other array with `model`; the fused
  kernels are new arrays (the projections' weights twice in memory while both live). Outputs
  match the unfused model's up to float rounding (a wider matmul may sum in another order).
  """
  fused = nnx.clone(model)
  for _, module in list(nnx.iter_modules(fused)):
    if isinstance(module, Attention) and getattr(module, 'qkv_proj', None) is None:
      module.qkv_proj = FusedLinear([module.q_proj, module.k_proj, module.v_proj])
      del module.q_proj, module.k_proj, module.v_proj
    elif isinstance(module, MLP) and getattr(module, 'gate_up', None) is None:
      module.gate_up = FusedLinear([module.gate, module.up])
      del module.gate, module.up
  return fused


class RMSNorm(nnx.RMSNorm):
  """`nnx.RMSNorm`; in half precision on CPU its mean of squares is summed in a fixed order,
  so a row normalises to the same bits in any block (`products`: decoding stays exact), and it
  scales in float32 by the scale as stored (`float32_norm_scales`)."""

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    if mask is not None or not products.on_fast_path(self.dtype or x.dtype):
      return super().__call__(x, mask)
    (x,) = self.promote_dtype((x,), dtype=self.dtype)
    scale = self.scale[...].astype(jnp.float32)
    wide = x.astype(jnp.float32)
    mean_square = products.ordered_sum(wide * wide, -1, keepdims=True) / x.shape[-1]
    return (x * (jax.lax.rsqrt(mean_square + self.epsilon) * scale)).astype(self.dtype)


def float32_norm_scales(model: nnx.Module) -> nnx.Module:
  """A copy of `model` for decoding whose half-precision norms on the fast path (CPU) keep
  their scales in float32, the same values (that path scales in float32).

  Converted inside a decoding loop, XLA hoists each norm use's conversion out of the loop as
  one more loop-carried array: 191 of the 669 in SmolLM2's `auto` loop. Without them and RoPE's
  184 (`_inverse_frequencies`) that loop compiled 11% faster on 2 CPU cores (20.8 s against
  23.5 s), its steps as fast. The copy shares every other array.
  """
  wide = nnx.clone(model)
  for _, module in list(nnx.iter_modules(wide)):
    if (isinstance(module, RMSNorm) and products.on_fast_path(module.dtype or module.scale.dtype)
        and module.scale.dtype != jnp.float32):
      module.scale.value = module.scale[...].astype(jnp.float32)
  return wide


def rms_norm(cfg: TransformerConfig, *, rngs: nnx.Rngs, features: int | None = None):
  return RMSNorm(features or cfg.embed_dim, epsilon=cfg.norm_eps, dtype=dtype_of(cfg.dtype),
                 param_dtype=dtype_of(cfg.param_dtype),
                 scale_init=partitioned(nnx.initializers.ones_init(), 'norm'), rngs=rngs)


class Block(nnx.Module):
  """Pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.attn_norm = rms_norm(cfg, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = rms_norm(cfg, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask, cache=None, lengths=None):
    x = mesh_lib.constrain_batch(x)  # Rows split over the batch axes in a sharded train step.
    attended, cache = self.attn(self.attn_norm(x), positions, mask, cache, lengths)
    x = x + attended
    return mesh_lib.constrain_batch(x + self.mlp(self.mlp_norm(x))), cache


def _block_output(block, x, positions, mask):
  return block(x, positions, mask)[0]


# Blocks whose activations are recomputed in the backward pass (training forward only): all of
# them ('full'), or all but the matmul outputs ('dots_saveable').
_rematerialised_blocks = {
    'full': nnx.remat(_block_output),
    'dots_saveable': nnx.remat(_block_output, policy=products.SAVE_DOTS),
}


class _StaticMask:
  """A block mask known when tracing, as a static argument of `jax.jit` (hashed by value), so
  that attention still knows it inside (`kv_cache.attend`)."""

  def __init__(self, mask):
    self.mask = np.asarray(mask, bool)
    self._key = (self.mask.shape, self.mask.tobytes())

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _StaticMask) and self._key == other._key


@functools.partial(jax.jit, static_argnames=('graphdef', 'static_mask'))
def _cached_block(graphdef, state, x, positions, mask, layer_cache, lengths, static_mask=None):
  mask = static_mask.mask if static_mask is not None else mask
  return nnx.merge(graphdef, state)(x, positions, mask, layer_cache, lengths)


def cached_layer(graphdef, state, x: Array, positions: Array, mask, layer_cache, lengths):
  """nnx.merge(graphdef, state)(x, ...) -> (x, layer cache) on a cached step, traced once for
  all the layers of one shape: jit reuses the first layer's trace for the others, and XLA
  inlines the calls. SmolLM2's 30 layers: tracing a verification step took 0.74 s, most of it
  tracing attention 30 times, now 0.07 s; its `auto` loop and prefill compile in 39 s, not 53.

  The function is the same, but in half precision XLA fuses it otherwise, and some results
  differ in their last bit from the layers traced one by one (a fifth of SmolLM2's layer-0
  values, by one bfloat16 step). One-token steps and verification blocks run the same layers,
  so speculative decoding still equals its own autoregressive decoding exactly."""
  if isinstance(mask, jax.core.Tracer):
    return _cached_block(graphdef, state, x, positions, mask, layer_cache, lengths)
  return _cached_block(graphdef, state, x, positions, None, layer_cache, lengths,
                       static_mask=_StaticMask(mask))


def call_block(block: 'Block', x: Array, positions: Array, mask: Array, layer_cache=None,
               lengths=None, remat: bool | str = False):
  """block(x) -> (x, layer cache); rematerialised when asked and no cache is involved.

  `remat`: False, True (= 'full') or a key of `_TRUNK_CHECKPOINT_POLICIES`.
  """
  if remat and layer_cache is None:
    policy = 'full' if remat is True else remat
    return _rematerialised_blocks[policy](block, x, positions, mask), None
  if layer_cache is not None and lengths is not None:
    return cached_layer(*nnx.split(block), x, positions, mask, layer_cache, lengths)
  return block(x, positions, mask, layer_cache, lengths)


def run_blocks(blocks, x: Array, positions: Array, mask: Array,
               cache: kv_cache_lib.KVCache | None, lengths: Array | None,
               first_layer: int = 0, remat: bool | str = False
               ) -> tuple[Array, list[tuple[Array, Array]]]:
  """Runs `blocks` in order; with a cache, block i uses cache layer first_layer + i."""
  updated = []
  for i, block in enumerate(blocks):
    layer_cache = None
    if cache is not None:
      layer_cache = (cache.keys[first_layer + i], cache.values[first_layer + i])
    x, layer_cache = call_block(block, x, positions, mask, layer_cache, lengths, remat)
    updated.append(layer_cache)
  return x, updated


def stacked_blocks(cfg: TransformerConfig, *, rngs: nnx.Rngs) -> 'Block':
  """One `Block` whose parameters are cfg.num_layers layers stacked on a leading 'layers' axis
  (each layer drawn from its own split of `rngs`)."""
  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(layer_rngs):
    return Block(cfg, rngs=layer_rngs)
  return make(rngs)


def scan_blocks(blocks: 'Block', x: Array, positions: Array, mask: Array,
                cache: kv_cache_lib.KVCache | None, lengths: Array | None,
                num_layers: int, remat: str = 'none', layers: tuple[int, int] | None = None
                ) -> tuple[Array, list[tuple[Array, Array]] | None]:
  """Runs stacked `blocks` (see `stacked_blocks`) over their layer axis.

  Runs layers [start, stop) = `layers` (all of them when None). Without a cache (training,
  evaluation): one `jax.lax.scan`, its body rematerialised by `remat`'s policy
  (`_TRUNK_CHECKPOINT_POLICIES`). With a cache, layer i reads and writes cache layer i (the
  trunk's layers come first), one layer after another; the updated (keys, values) of layers
  start.. come back per layer, as `run_blocks` returns them.
  """
  graphdef, state = nnx.split(blocks)
  start, stop = (0, num_layers) if layers is None else layers
  if cache is None and (start, stop) != (0, num_layers):
    state = jax.tree.map(lambda leaf: leaf[start:stop], state)

  def body(h, layer):
    layer_state, layer_cache = layer
    h, layer_cache = nnx.merge(graphdef, layer_state)(h, positions, mask, layer_cache, lengths)
    return h, layer_cache

  if cache is None:
    if remat in _TRUNK_CHECKPOINT_POLICIES:
      body = jax.checkpoint(body, policy=_TRUNK_CHECKPOINT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(body, x, (state, None))
    return x, None
  # Cached steps (prefill, decoding) run the layers one after another on static slices of
  # the stacked weights, each on its own cache layer: a scan needs the cache's layers stacked
  # (a copy of the whole cache per step). Greedy decoding of an 8-layer tiny model on CPU ran
  # at 0.6x the unrolled model's speed with a scan, 0.8x this way.
  updated = []
  for i in range(start, stop):
    layer_state = jax.tree.map(lambda leaf, i=i: leaf[i], state)
    x, layer_cache = cached_layer(graphdef, layer_state, x, positions, mask,
                                  (cache.keys[i], cache.values[i]), lengths)
    updated.append(layer_cache)
  return x, updated


def take_rows(table: Array, ids: Array) -> Array:
  """table [V, D] rows at integer ids [...] -> [..., D] (an embedding lookup).

  A half-precision table on CPU is read as its raw bits: XLA:CPU gathers half-precision rows
  through float32, and in a decoding loop it hoisted that conversion of the whole table out of
  the loop, so every call converted all of it (SmolLM2: 28M values, 35 ms a call).
  """
  if not products.on_fast_path(table.dtype):
    return jnp.take(table, ids, axis=0)
  return _take_half_rows(table, ids)


@jax.custom_vjp
def _take_half_rows(table: Array, ids: Array) -> Array:
  # The barrier ties the table to these ids: in a loop XLA cannot hoist the bits view, which
  # it copied whole once per call (12 ms on SmolLM2: a server's one-step calls paid it each).
  table, ids = jax.lax.optimization_barrier((table, ids))
  bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
  return jax.lax.bitcast_convert_type(jnp.take(bits, ids, axis=0), table.dtype)


def _take_half_rows_forward(table, ids):
  # The backward pass needs the table's rows and dtype only: an empty [V, 0] array keeps them
  # without keeping the table (a cast copy, when a float32 table is read in half precision).
  return _take_half_rows(table, ids), (jnp.zeros((table.shape[0], 0), table.dtype), ids)


def _take_half_rows_backward(residuals, grad):
  rows, ids = residuals
  zeros = jnp.zeros((rows.shape[0], grad.shape[-1]), rows.dtype)
  return zeros.at[ids].add(grad.astype(rows.dtype)), None


_take_half_rows.defvjp(_take_half_rows_forward, _take_half_rows_backward)


class Transformer(nnx.Module):
  """The trunk. `__call__` returns the last hidden state before the final norm."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.embedding = nnx.Embed(
        cfg.vocab_size, cfg.embed_dim, dtype=dtype_of(cfg.dtype),
        param_dtype=dtype_of(cfg.param_dtype),
        embedding_init=partitioned(nnx.initializers.normal(0.02), 'vocab', 'embed'), rngs=rngs)
    if cfg.scan_layers:
      self.blocks = stacked_blocks(cfg, rngs=rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = rms_norm(cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      self.output = nnx.Param(partitioned(nnx.initializers.normal(cfg.embed_dim ** -0.5),
                                          'embed', 'vocab')(
          rngs.params(), (cfg.embed_dim, cfg.vocab_size), dtype_of(cfg.param_dtype)))

  def embed(self, tokens: Array) -> Array:
    """[B, T] ids -> [B, T, D]."""
    table = self.embedding.embedding[...]
    return take_rows(table.astype(self.embedding.dtype or table.dtype), tokens)

  def unembedding(self) -> Array:
    """The [D, V] output matrix (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return self.embedding.embedding[...].T
    return self.output[...]

  def logits(self, normed: Array) -> Array:
    """Projects already-normalised hidden states [..., D] to logits [..., V] in float32."""
    dtype = dtype_of(self.cfg.dtype)
    if self.cfg.tie_embeddings:
      # Contract the embedding [V, D] in place: `x @ E.T` made XLA:CPU copy the transposed
      # matrix (V x D floats) on every call, which halved the speed of few-row projections.
      weights = self.embedding.embedding[...].astype(dtype)
      return products.einsum('...d,vd->...v', normed, weights,
                             preferred_element_type=jnp.float32)
    return products.einsum('...d,dv->...v', normed, self.output[...].astype(dtype),
                           preferred_element_type=jnp.float32)

  def __call__(self, tokens: Array, positions: Array, segment_ids: Array | None = None, *,
               cache: kv_cache_lib.KVCache | None = None, lengths: Array | None = None,
               block_mask: Array | None = None):
    """Runs the trunk.

    Args:
      tokens: [B, T] ids.
      positions: [B, T] rotary positions.
      segment_ids: [B, T] document ids for packed training rows (0 = padding); training only.
      cache: if given, the new tokens are written at slots `lengths` [B] onward.
      block_mask: [T, T] or [B, T, T] visibility inside the new block; causal by default.

    Returns:
      (hidden [B, T, D] before the final norm, updated cache or None). Only the trunk's first
      `num_layers` cache layers are used and returned updated; others pass through.
    """
    if cache is None:
      return self.train_forward(tokens, positions, segment_ids)[0], None
    hidden, _, cache = self.cached_forward(tokens, positions, cache, lengths, block_mask)
    return hidden, cache

  def cached_forward(self, tokens: Array, positions: Array, cache: kv_cache_lib.KVCache,
                     lengths: Array, block_mask: Array | None = None,
                     layer_inputs: Sequence[int] = ()
                     ) -> tuple[Array, dict[int, Array], kv_cache_lib.KVCache]:
    """A cached step (`__call__` with a cache), also returning the inputs of some layers.

    Args:
      tokens, positions, cache, lengths, block_mask: as `__call__`.
      layer_inputs: indices i in [0, L) of layers whose input [B, T, D] to return (head
        families that run trunk layers on their own tokens ask for them in the verification
        pass, `HeadFamily.trunk_layer_inputs`).

    Returns:
      (hidden [B, T, D] before the final norm, {i: layer i's input}, the updated cache).
    """
    x = self.embed(tokens)
    t = tokens.shape[1]
    if block_mask is None:
      block_mask = jnp.tril(jnp.ones((t, t), bool))
    inputs, start = {}, 0
    for stop in self._segments(layer_inputs):
      if stop > start:
        x, updated = self._run_blocks(x, positions, block_mask, cache, lengths, (start, stop))
        cache = replace_layers(cache, start, updated)
      if stop < self.cfg.num_layers:
        inputs[stop] = x
      start = stop
    return x, inputs, cache

  def _segments(self, layer_inputs: Sequence[int]) -> list[int]:
    """The requested layer inputs, sorted, then L: where each run of layers stops."""
    num_layers = self.cfg.num_layers
    wanted = sorted(set(int(i) for i in layer_inputs))
    if wanted and not 0 <= wanted[0] <= wanted[-1] < num_layers:
      raise ValueError(f'Trunk layer inputs {wanted} asked for; the trunk has layers 0..'
                       f'{num_layers - 1} (model.num_layers={num_layers}).')
    return wanted + [num_layers]

  def train_forward(self, tokens: Array, positions: Array, segment_ids: Array | None = None,
                    layer_inputs: Sequence[int] = ()) -> tuple[Array, dict[int, Array]]:
    """The training pass (no cache), also returning the inputs of some layers.

    Args:
      tokens, positions, segment_ids: as `__call__` (segment_ids None: one document per row).
      layer_inputs: indices i in [0, L) of layers whose input (the residual stream entering
        layer i, [B, T, D]) to return; head families ask for them
        (`HeadFamily.trunk_layer_inputs`).

    Returns:
      (hidden [B, T, D] before the final norm, {i: layer i's input [B, T, D]}). The layers run
      in segments between the requested inputs (scanned: one scan per segment), which
      computes the same values as one pass.
    """
    num_layers = self.cfg.num_layers
    segments = self._segments(layer_inputs)
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    mask = training_mask(segment_ids)
    x = self.embed(tokens)
    inputs, start = {}, 0
    for stop in segments:
      if stop > start:
        x = self._run_blocks(x, positions, mask, None, None, (start, stop))[0]
      if stop < num_layers:
        inputs[stop] = x
      start = stop
    return x, inputs

  def layer(self, i: int) -> 'Block':
    """Layer i as a `Block` (scanned: a module over the stacked weights' slice i, which shares
    them in the traced computation: gradients reach the stack)."""
    if not self.cfg.scan_layers:
      return self.blocks[i]
    graphdef, state = nnx.split(self.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf[i], state))

  def _run_blocks(self, x, positions, mask, cache, lengths, layers=None):
    """Layers [start, stop) = `layers` (None: all) in order, scanned or unrolled; remat'ed by
    `cfg.remat` without a cache. With a cache, layer i uses cache layer i; the updated
    (keys, values) of the layers run come back in order."""
    remat = self.cfg.remat if self.cfg.remat in _TRUNK_CHECKPOINT_POLICIES else False
    if self.cfg.scan_layers:
      return scan_blocks(self.blocks, x, positions, mask, cache, lengths, self.cfg.num_layers,
                         self.cfg.remat, layers=layers)
    start, stop = (0, self.cfg.num_layers) if layers is None else layers
    return run_blocks([self.blocks[i] for i in range(start, stop)], x, positions, mask, cache,
                      lengths, first_layer=start, remat=remat)

def replace_layers(cache: kv_cache_lib.KVCache, first_layer: int,
                   updated: list[tuple[Array, Array]]) -> kv_cache_lib.KVCache:
  """The cache with layers first_layer.. replaced by `updated` (keys, values) pairs."""
  keys, values = list(cache.keys), list(cache.values)
  for i, (k, v) in enumerate(updated):
    keys[first_layer + i], values[first_layer + i] = k, v
  return kv_cache_lib.KVCache(keys=tuple(keys), values=tuple(values))
