"""Trunk + multi-token heads + shared unembedding.

Entry points:
  * `__call__` (training): hidden states of the trunk and of every head, [K+1, B, T, D], ready
    for the shared unembedding. The loss turns them into logits a chunk at a time, so the
    full-vocabulary logits of all heads never exist at once.
  * `step` (prefill and verification): T new tokens per row through the trunk with a KV cache,
    plus the `features` the heads draft from (computed in the same pass by families that run
    in it).
  * `draft_logits`: the heads' draft logits [depth, B, V] at the last accepted token (or
    [depth, B, N] over a draft vocabulary's N ids); `draft_tree`: their drafts for every node
    of a static tree below it (what the decode loop's drafters read).
  * `logits`: projects hidden states through the shared output layer.

Everything family-specific sits behind the `mtp.model.heads.HeadFamily` protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from mtp.model import heads as heads_lib
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer

Array = jax.Array


def upgrade_legacy_config(config):
  """A `config.json` dict (or ConfigDict) written before `model.num_heads` was renamed
  `model.num_attention_heads`, with the new key; other configs come back unchanged.

  Changes `config` in place and returns it.
  """
  model = config['model'] if 'model' in config else None
  if model is not None and 'num_heads' in model and 'num_attention_heads' not in model:
    value = model['num_heads']
    if isinstance(model, dict):
      del model['num_heads']
      model['num_attention_heads'] = value
    else:  # A ConfigDict: its keys cannot be deleted while locked.
      with model.unlocked():
        del model['num_heads']
        model['num_attention_heads'] = value
  return config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The trunk's shape and the heads: built from `config.model` by `from_config`.

  `head_options` holds the head family's own `config.model` keys (its `OPTIONS`) as sorted
  (key, value) pairs; the family's defaults fill in missing ones.
  """
  trunk: transformer.TransformerConfig
  mtp_num_heads: int = 0
  mtp_head_type: str = 'medusa'
  head_options: tuple[tuple[str, Any], ...] = ()

  @classmethod
  def from_config(cls, model_config) -> 'ModelConfig':
    model_config = dict(model_config)
    head_type = model_config.get('mtp_head_type', 'medusa')
    options = heads_lib.FAMILIES[head_type].OPTIONS if head_type in heads_lib.FAMILIES else {}
    return cls(trunk=transformer.TransformerConfig.from_config(model_config),
               mtp_num_heads=model_config.get('mtp_num_heads', 0), mtp_head_type=head_type,
               head_options=tuple(sorted((k, model_config[k]) for k in options
                                         if k in model_config)))

  @property
  def family(self) -> type[heads_lib.HeadFamily]:
    return heads_lib.family(self.mtp_head_type)

  @property
  def options(self) -> dict[str, Any]:
    """The family's options: its defaults, overridden by `head_options`."""
    return {**self.family.OPTIONS, **dict(self.head_options)}

  @property
  def trunk_layer_inputs(self) -> tuple[int, ...]:
    """Trunk layers whose inputs the heads' training forward reads (`HeadFamily.
    trunk_layer_inputs`); () without heads."""
    if not self.mtp_num_heads:
      return ()
    return tuple(self.family.trunk_layer_inputs(self.trunk, self.mtp_num_heads, self.options))

  def validate(self) -> None:
    self.trunk.validate()
    family = self.family  # Raises for an unknown name.
    if self.mtp_num_heads < 0:
      raise ValueError(f'model.mtp_num_heads must be >= 0, got {self.mtp_num_heads}.')
    family.validate_options(self.options)
    layers = self.trunk_layer_inputs  # Raises for options that do not fit the trunk.
    if any(not 0 <= i < self.trunk.num_layers for i in layers):
      raise ValueError(f'model.mtp_head_type={self.mtp_head_type!r} reads the inputs of trunk '
                       f'layers {list(layers)}; the trunk has layers 0..'
                       f'{self.trunk.num_layers - 1} (model.num_layers).')


def in_precision(config: ModelConfig, params: nnx.State,
                 dtype: str) -> tuple[nnx.GraphDef, nnx.State]:
  """The definition of a model of `config` with weights and activations in `dtype` ('float32' |
  'bfloat16'), and `params` (of a model of `config`) cast to it."""
  config = dataclasses.replace(config, trunk=dataclasses.replace(config.trunk, dtype=dtype,
                                                                 param_dtype=dtype))
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: MTPModel(config, rngs=nnx.Rngs(0))))
  return graphdef, jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


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
  """A Llama-style trunk with K multi-token heads sharing its output layer.

  The heads are a `heads_lib.HeadFamily` picked by `cfg.mtp_head_type`; this class calls the
  protocol only, and never names a family.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.trunk = transformer.Transformer(cfg.trunk, rngs=rngs)
    self.heads = (cfg.family(cfg.trunk, cfg.mtp_num_heads, cfg.options, rngs=rngs)
                  if cfg.mtp_num_heads else None)

  @property
  def mtp_num_heads(self) -> int:
    return self.cfg.mtp_num_heads

  @property
  def feature_loss_weight(self) -> float:
    """The heads' feature-regression weight in training (`HeadFamily.feature_loss_weight`)."""
    return self.heads.feature_loss_weight if self.heads is not None else 0.0

  @property
  def num_cache_layers(self) -> int:
    """Trunk layers plus the heads' own (those of heads that attend)."""
    extra = self.heads.num_cache_layers if self.heads is not None else 0
    return self.cfg.trunk.num_layers + extra

  @property
  def num_verified_cache_layers(self) -> int:
    """Cache layers a verification `step` writes (the trunk's, and heads that run in it)."""
    extra = self.heads.num_verified_cache_layers if self.heads is not None else 0
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

  def __call__(self, tokens: Array, positions: Array, segment_ids: Array | None = None,
               head_positions: Array | None = None) -> Array:
    """Training forward.

    Args:
      tokens, positions, segment_ids: [B, T] (segment id 0 marks padding).
      head_positions: [P] the positions where the heads' outputs are read (None: all); a
        family that can (`HeadFamily.TRAINS_AT_HEAD_POSITIONS`) computes only those.

    Returns:
      [K+1, B, T, D]: entry 0 is the trunk's normalised hidden state (next token), entry k the
      output of head k (token t+1+k).
    """
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    hidden, layer_inputs = self.trunk.train_forward(tokens, positions, segment_ids,
                                                    self.cfg.trunk_layer_inputs)
    return self.outputs_from_trunk(hidden, tokens, positions, segment_ids, layer_inputs,
                                   head_positions)

  def outputs_from_trunk(self, hidden: Array, tokens: Array, positions: Array,
                         segment_ids: Array, layer_inputs: Mapping[int, Array] | None = None,
                         head_positions: Array | None = None) -> Array:
    """The training forward after the trunk: its final norm, then the heads.

    Training heads on a frozen trunk can cache the trunk's `hidden` once and start here
    (families that read trunk layer inputs, `ModelConfig.trunk_layer_inputs`, need those too:
    `distill.cache_trunk_states` keeps both).

    Args:
      hidden: [B, T, D] the trunk's last hidden state (before the final norm).
      tokens, positions, segment_ids: [B, T] as for `__call__`.
      layer_inputs: {i: [B, T, D]} the inputs of the trunk layers the heads read
        (`Transformer.train_forward`); needed only by families that ask for some.
      head_positions: as `__call__`.

    Returns:
      [K+1, B, T, D] as `__call__`.

    Raises:
      ValueError: the heads read trunk layer inputs that `layer_inputs` lacks.
    """
    normed = self.trunk.final_norm(hidden)
    outputs = [normed]
    if self.heads is not None:
      mask = transformer.training_mask(segment_ids)
      # Passed only to families that ask: the others' `__call__` has no such argument.
      extra = {}
      needed = self.cfg.trunk_layer_inputs
      if needed:
        missing = [i for i in needed if layer_inputs is None or i not in layer_inputs]
        if missing:
          raise ValueError(
              f'model.mtp_head_type={self.cfg.mtp_head_type!r} reads the inputs of trunk '
              f'layers {missing}, which were not given.')
        extra['layer_inputs'] = {i: layer_inputs[i] for i in needed}
      if self.cfg.family.TRAINS_AT_HEAD_POSITIONS:
        extra['head_positions'] = head_positions
      outputs += self.heads(self.trunk, hidden, normed, tokens, positions, mask, **extra)
    return jnp.stack(outputs)

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
    if block_mask is None:
      block_mask = heads_lib.causal_mask(tokens.shape[1])
    with_heads = with_heads and self.heads is not None
    needed = self.cfg.trunk_layer_inputs if with_heads else ()
    hidden, layer_inputs, cache = self.trunk.cached_forward(tokens, positions, cache, lengths,
                                                            block_mask, needed)
    normed = self.trunk.final_norm(hidden)
    features = None
    if with_heads:
      # Families that read trunk layer inputs get them, and the trunk, to run its layers on
      # their own tokens; the others' `verify` has no such arguments.
      extra = dict(trunk=self.trunk, layer_inputs=layer_inputs) if needed else {}
      features, cache = self.heads.verify(hidden, normed, positions, block_mask, cache, lengths,
                                          first_layer=self.cfg.trunk.num_layers, **extra)
    return StepOutput(hidden=hidden, normed=normed, features=features), cache

  def draft_vocab(self, ids: Array) -> heads_lib.DraftVocab:
    """A draft vocabulary's ids [N] with their output-layer rows, gathered once for many
    `draft_logits` calls (e.g. outside a decode loop's steps)."""
    return heads_lib.gather_draft_vocab(self.trunk, ids)

  def draft_logits(self, features, tokens: Array, last_index: Array,
                   cache: kv_cache_lib.KVCache, lengths: Array, depth: int,
                   vocab: Array | None = None) -> tuple[Array, kv_cache_lib.KVCache]:
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
      vocab: a draft vocabulary (`decode.draft_vocab`): `draft_vocab(ids)`'s result, or its
        [N] int32 ids (gathered on each call); the heads project onto those N rows of the
        output layer only. None: the whole vocabulary.

    Returns:
      (logits [depth, B, V] of heads 1..depth, or [depth, B, N] over `vocab`'s ids, cache).
    """
    # Passed only when given: a family written before draft vocabularies still drafts.
    extra = {} if vocab is None else {'vocab': vocab}
    return self.heads.draft(self.trunk, features, tokens, last_index, cache, lengths, depth,
                            first_layer=self.cfg.trunk.num_layers, **extra)

  def draft_tree(self, features, tokens: Array, last_index: Array,
                 cache: kv_cache_lib.KVCache, lengths: Array, tree,
                 vocab: Array | None = None, mask=None, budget: int | None = None
                 ) -> tuple[heads_lib.TreeDrafts, kv_cache_lib.KVCache]:
    """The heads' drafts for every node of a static tree below the last accepted token.

    Args:
      features, tokens, last_index, cache, lengths, vocab: as `draft_logits`'s (`tokens` with
        tree.max_depth scratch columns).
      tree: a static tree (`mtp.decode.trees.Tree`) no deeper than the heads.
      mask: maps draft logits [..., V or N] to the same with ids never emitted at -inf.
      budget: at most this many nodes (root included) will be chosen by score; None: all.

    Returns:
      (`heads.TreeDrafts`: tokens and path scores [B, M], cache).
    """
    return self.heads.draft_tree(self.trunk, features, tokens, last_index, cache, lengths,
                                 tree, self.cfg.trunk.num_layers, vocab=vocab, mask=mask,
                                 budget=budget)
