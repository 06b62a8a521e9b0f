"""Trunk + multi-token heads + shared unembedding.

Three entry points:
  * `__call__` (training): hidden states of the trunk and of every head, [K+1, B, T, D], ready
    for the shared unembedding. The loss turns them into logits a chunk at a time, so the
    full-vocabulary logits of all heads never exist at once.
  * `step` (prefill and verification): T new tokens per row through the trunk with a KV cache,
    plus the heads' hidden states where the family can compute them in the same pass.
  * `logits`: projects hidden states through the shared output layer.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import heads as heads_lib
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The trunk's shape and the heads: built from `config.model` by `from_config`."""
  trunk: transformer.TransformerConfig
  mtp_num_heads: int = 0
  mtp_head_type: str = 'medusa'
  medusa_num_layers: int = 1

  @classmethod
  def from_config(cls, model_config) -> 'ModelConfig':
    model_config = dict(model_config)
    return cls(trunk=transformer.TransformerConfig.from_config(model_config),
               mtp_num_heads=model_config.get('mtp_num_heads', 0),
               mtp_head_type=model_config.get('mtp_head_type', 'medusa'),
               medusa_num_layers=model_config.get('medusa_num_layers', 1))

  def validate(self) -> None:
    self.trunk.validate()
    if self.mtp_head_type not in heads_lib.HEAD_TYPES:
      raise ValueError(f'Unknown model.mtp_head_type {self.mtp_head_type!r}; expected one of '
                       f'{", ".join(heads_lib.HEAD_TYPES)}.')
    if self.mtp_num_heads < 0:
      raise ValueError(f'model.mtp_num_heads must be >= 0, got {self.mtp_num_heads}.')
    if self.mtp_head_type == 'medusa' and self.medusa_num_layers < 1:
      raise ValueError(f'model.medusa_num_layers must be >= 1, got {self.medusa_num_layers}.')


@flax.struct.dataclass
class StepOutput:
  """What one cached step returns.

  Attributes:
    hidden: [B, T, D] the trunk's last hidden state before the final norm (h_0).
    normed: [B, T, D] after the final norm: `model.logits(normed)` are the trunk's logits.
    features: what the heads draft from, a pytree of [B, T, ...] arrays (one entry per block
      token, family-defined), or None when the step ran without heads. Gathered along the
      accepted path, it is what `MTPModel.draft_logits` reads.
  """
  hidden: Array
  normed: Array
  features: object


class MTPModel(nnx.Module):
  """A Llama-style trunk with K multi-token heads sharing its output layer."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.trunk = transformer.Transformer(cfg.trunk, rngs=rngs)
    k = cfg.mtp_num_heads
    if k == 0:
      self.heads = None
    elif cfg.mtp_head_type == 'medusa':
      self.heads = heads_lib.MedusaHeads(cfg.trunk, k, cfg.medusa_num_layers, rngs=rngs)
    elif cfg.mtp_head_type == 'parallel':
      self.heads = heads_lib.ParallelHeads(cfg.trunk, k, rngs=rngs)
    else:
      self.heads = heads_lib.SequentialHeads(cfg.trunk, k, rngs=rngs)

  @property
  def num_heads(self) -> int:
    return self.cfg.mtp_num_heads

  @property
  def num_cache_layers(self) -> int:
    """Trunk layers plus one per head layer that attends (parallel and sequential heads)."""
    extra = self.heads.num_cache_layers if self.heads is not None else 0
    return self.cfg.trunk.num_layers + extra

  def init_cache(self, batch_size: int, capacity: int, dtype=None) -> kv_cache_lib.KVCache:
    """An empty cache for every attending layer, [batch_size, capacity] slots each."""
    c = self.cfg.trunk
    return kv_cache_lib.init_cache(self.num_cache_layers, batch_size, capacity, c.num_kv_heads,
                                   c.head_dim, dtype or transformer.dtype_of(c.dtype))

  def unembedding(self) -> Array:
    """The shared [D, V] output matrix."""
    return self.trunk.unembedding()

  def logits(self, normed: Array) -> Array:
    """Normalised hidden states [..., D] -> float32 logits [..., V]."""
    return self.trunk.logits(normed)

  def shifted_embeddings(self, tokens: Array) -> list[Array]:
    """For sequential heads: entry k-1 is embed(x_{t+k}) at t (zeros past the end), k=1..K."""
    embeds = self.trunk.embed(tokens)
    t = tokens.shape[1]
    out = []
    for k in range(1, self.num_heads + 1):
      shifted = embeds[:, k:]
      out.append(jnp.pad(shifted, ((0, 0), (0, min(k, t)), (0, 0)))[:, :t])
    return out

  def __call__(self, tokens: Array, positions: Array, segment_ids: Array | None = None) -> Array:
    """Training forward.

    Args:
      tokens, positions, segment_ids: [B, T] (segment id 0 marks padding).

    Returns:
      [K+1, B, T, D]: entry 0 is the trunk's normalised hidden state (next token), entry k the
      output of head k (token t+1+k).
    """
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    hidden, _ = self.trunk(tokens, positions, segment_ids)
    return self.outputs_from_trunk(hidden, tokens, positions, segment_ids)

  def outputs_from_trunk(self, hidden: Array, tokens: Array, positions: Array,
                         segment_ids: Array) -> Array:
    """The training forward after the trunk: its final norm, then the heads.

    Training heads on a frozen trunk can cache the trunk's `hidden` once and start here.

    Args:
      hidden: [B, T, D] the trunk's last hidden state (before the final norm).
      tokens, positions, segment_ids: [B, T] as for `__call__`.

    Returns:
      [K+1, B, T, D] as `__call__`.
    """
    normed = self.trunk.final_norm(hidden)
    outputs = [normed]
    if self.heads is not None:
      mask = transformer.training_mask(segment_ids)
      if self.cfg.mtp_head_type == 'medusa':
        outputs += self.heads(normed)
      elif self.cfg.mtp_head_type == 'parallel':
        outputs += self.heads(hidden, positions, mask)[0]
      else:
        outputs += self.heads(hidden, self.shifted_embeddings(tokens), positions, mask)[0]
    return jnp.stack(outputs)

  @property
  def num_verified_cache_layers(self) -> int:
    """Cache layers a verification `step` writes (the trunk's, and heads that run in it)."""
    if self.cfg.mtp_head_type == 'parallel':
      return self.num_cache_layers
    return self.cfg.trunk.num_layers

  def step(self, tokens: Array, positions: Array, cache: kv_cache_lib.KVCache,
           lengths: Array, block_mask: Array | None = None, *, with_heads: bool = True
           ) -> tuple[StepOutput, kv_cache_lib.KVCache]:
    """Cached forward of T new tokens per row (prefill or verification).

    Args:
      tokens: [B, T] new tokens, written at cache slots [lengths, lengths + T).
      positions: [B, T] their positions (lengths + depth for a candidate tree).
      cache: from `init_cache`.
      lengths: [B] committed slots per row.
      block_mask: [T, T] or [B, T, T]: which new tokens each new token sees; causal if None.
      with_heads: also compute what the heads draft from (`StepOutput.features`).

    Returns:
      (StepOutput, cache with the new tokens' keys and values written in every layer it ran).
    """
    hidden, cache = self.trunk(tokens, positions, cache=cache, lengths=lengths,
                               block_mask=block_mask)
    normed = self.trunk.final_norm(hidden)
    features = None
    if with_heads and self.heads is not None:
      if self.cfg.mtp_head_type == 'medusa':
        features = normed
      elif self.cfg.mtp_head_type == 'parallel':
        t = tokens.shape[1]
        if block_mask is None:
          block_mask = jnp.tril(jnp.ones((t, t), bool))
        mask = transformer.cached_mask(lengths, block_mask, cache.capacity)
        outputs, updated = self.heads(hidden, positions, mask, cache, lengths,
                                      first_layer=self.cfg.trunk.num_layers)
        features = jnp.stack(outputs, axis=2)  # [B, T, K, D]
        cache = transformer.replace_layers(cache, self.cfg.trunk.num_layers, updated)
      else:
        features = hidden
    return StepOutput(hidden=hidden, normed=normed, features=features), cache

  def draft_logits(self, features, tokens: Array, last_index: Array,
                   cache: kv_cache_lib.KVCache, lengths: Array, depth: int
                   ) -> tuple[Array, kv_cache_lib.KVCache]:
    """The heads' draft logits after a step, at the last accepted token of each row.

    Args:
      features: `StepOutput.features` along a contiguous run of T tokens from slot `lengths`
        (the prompt after a prefill; the accepted path after a verification).
      tokens: [B, T + depth] the tokens at those slots, known through last_index + 1 (the
        token the trunk just chose); later columns are scratch.
      last_index: [B] index of the last accepted token in the run: the drafts continue it.
      cache: heads that attend keep their layers here (written at the run's slots).
      lengths: [B] committed slots before the run.
      depth: heads to read (1..K).

    Returns:
      (logits [depth, B, V] of heads 1..depth, cache).
    """
    if self.cfg.mtp_head_type == 'medusa':
      # The cheap ResBlocks run on the one gathered position, not on the whole run.
      normed = _gather_rows(features, last_index)
      return self.logits(jnp.stack(self.heads(normed)[:depth])), cache
    if self.cfg.mtp_head_type == 'parallel':
      heads = jnp.moveaxis(_gather_rows(features, last_index), 1, 0)[:depth]  # [depth, B, D]
      return self.logits(heads), cache
    t = features.shape[1]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    h, logits = features, []
    for k in range(depth):
      h, normed, cache = self.sequential_module_step(k, h, tokens[:, k + 1:k + 1 + t], positions,
                                                     cache, lengths)
      head = self.logits(_gather_rows(normed, last_index))  # [B, V]
      logits.append(head)
      if k + 1 < depth:  # Module k + 2 reads this draft as token x_{t + k + 2} at last_index.
        top1 = jnp.argmax(head, axis=-1).astype(tokens.dtype)
        tokens = kv_cache_lib.write_rows(tokens, top1[:, None], last_index + k + 2)
    return jnp.stack(logits), cache

  def sequential_module_step(self, index: int, hidden_prev: Array, next_tokens: Array,
                             positions: Array, cache: kv_cache_lib.KVCache, lengths: Array,
                             block_mask: Array | None = None):
    """Runs sequential module `index` (0-based) on T tokens with its cache layer.

    Args:
      hidden_prev: [B, T, D] h_{k-1} at the T positions.
      next_tokens: [B, T] x_{t+k} at each position t (drafts where not yet known).

    Returns:
      (h_k [B, T, D], normalised output [B, T, D], updated cache).
    """
    t = next_tokens.shape[1]
    if block_mask is None:
      block_mask = jnp.tril(jnp.ones((t, t), bool))
    mask = transformer.cached_mask(lengths, block_mask, cache.capacity)
    layer = self.cfg.trunk.num_layers + index
    h, out, layer_cache = self.heads.layers[index](
        hidden_prev, self.trunk.embed(next_tokens), positions, mask,
        (cache.keys[layer], cache.values[layer]), lengths)
    return h, out, transformer.replace_layers(cache, layer, [layer_cache])


def _gather_rows(x: Array, index: Array) -> Array:
  """x[b, index[b]]: x [B, T, ...], index [B] -> [B, ...]."""
  index = index.reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, index, axis=1)[:, 0]
