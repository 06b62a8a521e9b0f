"""Multi-token prediction head families behind one protocol, and the registry of their names.

Head k (1..K) predicts token t+1+k from position t. Every family returns, per head, normalised
hidden states ready for the trunk's shared unembedding, so the loss and the decoder treat all
families alike. Shape letters are those of `mtp.model`.

A family is an `nnx.Module` subclass of `HeadFamily` that owns:
  * its parameters, built from the trunk's config, K and its own config options (`OPTIONS`:
    `config.model` keys with defaults, checked by `validate_options`);
  * its training forward (`__call__`): the trunk's states -> K arrays [B, T, D];
  * the trunk layer inputs that forward reads besides the last hidden state
    (`trunk_layer_inputs`, none by default): `MTPModel` then has the trunk return the residual
    stream entering those layers (`Transformer.train_forward`) and passes them to `__call__`
    as `layer_inputs` (a family that asks for none is called without that argument). Such a
    family may also rerun trunk layers on its own tokens: `trunk.layer(i)` is layer i's
    `Block`, sharing the trunk's weights. A cached trunk state
    (`distill.cache_trunk_states`) keeps those layers' inputs beside the last hidden state
    (`mtp.train.trunk_cache`), so a frozen trunk runs once for them too;
  * its KV-cache layers (`num_cache_layers`), which follow the trunk's layers in the cache;
  * whether it runs inside the verification pass (`RUNS_IN_VERIFICATION`; it then writes all
    of its cache layers there) and its part of that pass (`verify`), which returns the
    per-token `features` pytree ([B, T, ...] arrays) the family drafts from; a family with
    `trunk_layer_inputs` gets those layers' inputs for the new tokens there too, and the
    trunk (Speculative Streaming drafts the next block at every node of the block it
    verifies, in the same pass);
  * its drafting step (`draft`): from the features along a run of accepted tokens, the draft
    logits [depth, B, V] at the run's last accepted token (or [depth, B, N] over a draft
    vocabulary's N ids, FR-Spec, when given one: project through `DraftProjection`);
  * optionally its tree drafting (`draft_tree`): every node's draft of a static tree below
    that token (`tree_drafts`). The default reads `draft`'s logits by depth; EAGLE drafts each
    node's children from the node's own path (EAGLE-2);
  * an optional feature-regression loss beside the token loss (`feature_loss_weight`);
  * the FLOPs of its training forward (`train_flops`), from which `mtp.train.flops` reports
    a run's TFLOP/s and MFU;
  * its serving format (`hf_export`, optional): what `mtp.export.hf` writes for it beside the
    Hugging Face Llama directory of the trunk (`HFExport`); None if it has none. Its inverse,
    `hf_import`, finds the family's heads in such a directory for `import_weights`.

How to add a head family: write `mtp/model/heads/<name>.py` with one `HeadFamily` subclass that
implements the methods above (see `medusa.py` for the smallest, `sequential.py` for one that
drafts autoregressively with its own cache layers, `eagle.py` for one layer rolled forward,
`streaming.py` for one that reads trunk layer inputs and reruns the trunk's top layers),
then add one line to `FAMILIES` below.
`config.model.mtp_head_type=<name>` then trains it (`MTPModel.__call__`) and drafts with it
(`MTPModel.step` / `draft_logits`); nothing else names families. Give the module's list of
per-head children the attribute name `layers`, so parameter paths read `heads/layers/{k}/...`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.model import flops
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import products
from mtp.model import transformer
from mtp.model.heads import tree_drafts
from mtp.model.heads.legacy import is_legacy_tree, upgrade_legacy_tree  # noqa: F401  (the API)
from mtp.model.heads.tree_drafts import TreeDrafts  # noqa: F401  (the API)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HFExportContext:
  """What a family's Hugging Face export reads besides its own parameters.

  Attributes:
    trunk_cfg: the trunk's shape (L = trunk_cfg.num_layers, D, V, norm eps ...).
    embedding: [V, D] float32, the token embedding (`model.embed_tokens.weight`).
    unembedding: [V, D] float32, the shared output layer as Hugging Face stores it
      (`lm_head.weight`; the embedding when tied).
    block_tensors: (a `transformer.Block`, i) -> its weights under Llama layer i's Hugging Face
      names (`model.layers.{i}.self_attn.q_proj.weight`, ...; float32, [out, in]).
    draft_ids: [N] int32, the draft vocabulary the heads trained on (`mtp_head_draft_vocab`),
      or None (the whole vocabulary).
  """
  trunk_cfg: transformer.TransformerConfig
  embedding: np.ndarray
  unembedding: np.ndarray
  block_tensors: Callable[[transformer.Block, int], dict[str, np.ndarray]]
  draft_ids: np.ndarray | None = None


@dataclasses.dataclass
class HFSubdirectory:
  """A directory of its own inside the export: its `config.json` and its weights."""
  config: dict[str, Any]
  tensors: dict[str, np.ndarray]


@dataclasses.dataclass
class HFExport:
  """A family's part of a Hugging Face export. Arrays are float32 numpy; the exporter casts
  them to the export's dtype and shards them.

  Attributes:
    format: the serving format's name, for the export's summary (e.g. 'vllm-medusa').
    tensors: added to the Llama directory's weights (`model.safetensors`).
    config: keys added to the Llama directory's `config.json`.
    subdirectories: relative name -> a directory written inside the export.
  """
  format: str
  tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  config: dict[str, Any] = dataclasses.field(default_factory=dict)
  subdirectories: dict[str, HFSubdirectory] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HFImportSource:
  """A Hugging Face Llama directory as a family's `hf_import` reads it (`HFExport`'s inverse).

  Attributes:
    config: its config.json.
    trunk_cfg: the trunk's shape, read from it.
    embedding, unembedding: [V, D] float32, as in `HFExportContext`.
    tensors: its tensors outside the trunk (such as MTP layers L..), float32.
    subdirectory: a relative name -> that directory's config and float32 tensors, or None when
      it does not exist.
    block_params: (tensors, i) -> Llama layer i's Hugging Face tensors as a `transformer.Block`'s
      pure-dict parameters (ValueError naming a missing tensor).
  """
  config: Mapping[str, Any]
  trunk_cfg: transformer.TransformerConfig
  embedding: np.ndarray
  unembedding: np.ndarray
  tensors: Mapping[str, np.ndarray]
  subdirectory: Callable[[str], HFSubdirectory | None]
  block_params: Callable[[Mapping[str, np.ndarray], int], dict[str, Any]]


@dataclasses.dataclass
class HFImport:
  """A family's heads found in a Hugging Face directory.

  Attributes:
    num_heads: K (`model.mtp_num_heads`).
    options: the family's `config.model` options (keys of its `OPTIONS`).
    params: `nnx.to_pure_dict` of the family's module, float32.
    draft_ids: [N] int32, the draft vocabulary the heads score (`mtp_head_draft_vocab`), or
      None for the whole vocabulary.
  """
  num_heads: int
  options: dict[str, Any]
  params: dict[str, Any]
  draft_ids: Any = None


def take(tensors: Mapping[str, np.ndarray], name: str, where: str = '') -> np.ndarray:
  """tensors[name], or ValueError naming the missing tensor."""
  if name not in tensors:
    raise ValueError(f'{where}missing tensor {name}.')
  return tensors[name]


def check_shared(tensors: Mapping[str, np.ndarray], name: str, shared: np.ndarray,
                 what: str, where: str = '') -> None:
  """A copy of a shared matrix, where present, must be that matrix: mtp's heads share it."""
  if name in tensors and not np.array_equal(tensors[name], shared):
    raise ValueError(f'{where}{name} differs from the base model\'s {what}; mtp heads share '
                     f'the {what}, so heads with their own cannot be imported.')


def as_numpy(param) -> np.ndarray:
  """A parameter's value as a float32 numpy array (for exports)."""
  return np.asarray(param[...], np.float32)


class HeadFamily(nnx.Module):
  """The protocol every head family implements (an abstract base class).

  Families receive the trunk module itself (`transformer.Transformer`) where they need its
  shared parts: `trunk.embed` (token embeddings) and `trunk.logits` (the shared output layer).
  """
  # config.model keys this family reads, with their defaults.
  OPTIONS: ClassVar[Mapping[str, Any]] = {}
  # Whether `verify` runs inside the verification pass (and writes all the family's cache
  # layers there); otherwise the features are the trunk's own states and `verify` is free.
  RUNS_IN_VERIFICATION: ClassVar[bool] = False
  # Whether `__call__` takes `head_positions`, computing its outputs at those positions only.
  TRAINS_AT_HEAD_POSITIONS: ClassVar[bool] = False

  def __init__(self, trunk_cfg: transformer.TransformerConfig, num_heads: int,
               options: Mapping[str, Any], *, rngs: nnx.Rngs):
    """Builds K = num_heads heads; `options` holds every key of `OPTIONS`."""
    raise NotImplementedError

  @classmethod
  def validate_options(cls, options: Mapping[str, Any]) -> None:
    """Raises ValueError naming the config key of a bad option (`model.<key>`)."""

  @classmethod
  def train_flops(cls, trunk_cfg: transformer.TransformerConfig, num_heads: int,
                  options: Mapping[str, Any], batch_size: int, seq_len: int,
                  count: flops.AttentionCount = 'causal') -> flops.HeadFlops:
    """Forward FLOPs of K = num_heads heads' training pass (`__call__`) over B rows of T tokens.

    Count as `mtp.train.flops` does (its docstring): the matrix products only, 2 FLOPs per
    multiply-add; `flops.block_matmul_flops` and `flops.attention_flops` count a transformer
    layer. `mtp.train.flops` adds the backward passes.

    Args:
      trunk_cfg, num_heads, options: as `__init__` receives them.
      batch_size, seq_len: B and T.
      count: 'causal' or 'full' attention (`flops.AttentionCount`).

    Raises:
      flops.UnknownHeadFamily: the family has no count (this default).
    """
    del trunk_cfg, num_heads, options, batch_size, seq_len, count
    name = next((name for name, family in FAMILIES.items() if family is cls), cls.__qualname__)
    raise flops.UnknownHeadFamily(f'No FLOP count for head family {name!r} ({cls.__module__}): '
                                  'it does not implement HeadFamily.train_flops.')

  @classmethod
  def trunk_layer_inputs(cls, trunk_cfg: transformer.TransformerConfig, num_heads: int,
                         options: Mapping[str, Any]) -> tuple[int, ...]:
    """Trunk layers i in [0, L) whose inputs [B, T, D] (the residual stream entering layer i)
    the training forward reads, as `__call__(..., layer_inputs={i: ...})`; () by default.

    `ModelConfig.validate` calls it: raise ValueError naming an option (`model.<key>`) that
    does not fit the trunk (e.g. more layers than L).
    """
    del trunk_cfg, num_heads, options
    return ()

  @property
  def num_cache_layers(self) -> int:
    """KV-cache layers the family needs after the trunk's (0 if its heads do not attend)."""
    return 0

  @property
  def feature_loss_weight(self) -> float:
    """Weight of the feature-regression loss in training (0: none). Families whose outputs
    predict the trunk's features (EAGLE) regress head k's output at t onto the trunk's
    normalised state at t+k (`mtp.train.loss.feature_regression`)."""
    return 0.0

  @property
  def num_verified_cache_layers(self) -> int:
    """Of those, the layers a verification pass writes: all of them or none."""
    return self.num_cache_layers if self.RUNS_IN_VERIFICATION else 0

  def __call__(self, trunk: transformer.Transformer, hidden: Array, normed: Array,
               tokens: Array, positions: Array, mask: Array) -> list[Array]:
    """Training forward.

    Args:
      trunk: the trunk (for `embed`).
      hidden: [B, T, D] the trunk's last hidden state before the final norm (h_0).
      normed: [B, T, D] the same after the final norm.
      tokens, positions: [B, T].
      mask: [B, 1, T, T] the training attention mask (causal within each packed document).

    A family with `trunk_layer_inputs` also receives `layer_inputs`: {i: [B, T, D]} the
    trunk's input to each of those layers (keyword argument).

    A family with `TRAINS_AT_HEAD_POSITIONS` also receives `head_positions`: [P] int32, the
    positions where the heads' losses count this step (`mtp.train.loss.head_positions`), or
    None for all; its outputs elsewhere are never read and may be zeros. It then also takes
    `head_positions` (their number P, or None for T) in `train_flops`.

    Returns:
      K arrays [B, T, D]: head k's normalised hidden state (predicting token t+1+k).
    """
    raise NotImplementedError

  def verify(self, hidden: Array, normed: Array, positions: Array, block_mask: Array,
             cache: kv_cache_lib.KVCache, lengths: Array, first_layer: int
             ) -> tuple[Any, kv_cache_lib.KVCache]:
    """The family's part of a cached step (prefill or verification) of T tokens.

    Args:
      hidden, normed: [B, T, D] the trunk's states for the new tokens.
      positions: [B, T] their positions.
      block_mask: [T, T] or [B, T, T] visibility inside the new block.
      cache: the cache, the trunk's layers already written.
      lengths: [B] committed slots before the new tokens.
      first_layer: the family's first cache layer (the trunk's layer count).

    A family with `trunk_layer_inputs` also receives, as keywords, `trunk` (the
    `transformer.Transformer`, whose `layer(i)` it may run on its own tokens) and
    `layer_inputs` ({i: [B, T, D]} the new tokens' input to each of those layers); the cache
    then holds the new tokens' keys and values in every trunk layer.

    Returns:
      (features: a pytree of [B, T, ...] arrays, the cache with the layers it wrote).
    """
    raise NotImplementedError

  def draft(self, trunk: transformer.Transformer, features: Any, tokens: Array,
            last_index: Array, cache: kv_cache_lib.KVCache, lengths: Array, depth: int,
            first_layer: int, vocab: Array | None = None
            ) -> tuple[Array, kv_cache_lib.KVCache]:
    """Draft logits at the last accepted token (see `MTPModel.draft_logits`).

    Args:
      trunk: the trunk (for `embed` and `logits`).
      features: `verify`'s features along a contiguous run of T tokens from slot `lengths`.
      tokens: [B, T + depth] the run's tokens, known through last_index + 1; later columns are
        scratch.
      last_index: [B] index of the last accepted token in the run.
      cache: the family's layers may be written at the run's slots.
      lengths: [B] committed slots before the run.
      depth: heads to read (1..K).
      first_layer: the family's first cache layer.
      vocab: a draft vocabulary (FR-Spec) of N ids: a `DraftVocab` or [N] int32 ids; None
        for all V. Project through `DraftProjection(trunk, vocab)`: its logits are over those
        N ids, and a family that feeds its own top-1 back maps it to a token id with
        `DraftProjection.token_ids`.

    Returns:
      (float32 logits [depth, B, V] of heads 1..depth, or [depth, B, N] over `vocab`, cache).
    """
    raise NotImplementedError

  def draft_tree(self, trunk: transformer.Transformer, features: Any, tokens: Array,
                 last_index: Array, cache: kv_cache_lib.KVCache, lengths: Array, tree: Any,
                 first_layer: int, vocab: Array | None = None,
                 mask: Callable[[Array], Array] | None = None, budget: int | None = None
                 ) -> tuple[tree_drafts.TreeDrafts, kv_cache_lib.KVCache]:
    """Every node's draft of a static tree below the last accepted token (`tree_drafts`).

    By default by depth: `draft`'s logits along the top-1 chain, head d's top candidates for
    every node at depth d (`tree_drafts.by_depth`). A family whose drafter reads the tokens
    drafted above it (EAGLE) may instead draft each node's children from that node's own path.

    Args:
      trunk, features, tokens, last_index, cache, lengths, first_layer, vocab: as `draft`'s;
        `tokens` has tree.max_depth scratch columns.
      tree: the static tree (`mtp.decode.trees.Tree`), root = the last accepted token; no
        deeper than the heads.
      mask: maps draft logits [..., N] to the same with ids never emitted at -inf (None: all
        may be).
      budget: the caller chooses at most this many nodes, root included, by score
        (`dynamic_trees.select`; None: it reads every node). A node that cannot be among them
        may be left undrafted (score -inf), so may its descendants.

    Returns:
      (`TreeDrafts` [B, M], cache).
    """
    del budget  # Drafting by depth costs the same for every node.
    extra = {} if vocab is None else {'vocab': vocab}
    logits, cache = self.draft(trunk, features, tokens, last_index, cache, lengths,
                               tree.max_depth, first_layer, **extra)
    if mask is not None:
      logits = mask(logits)
    return tree_drafts.by_depth(tree, logits, DraftProjection(trunk, vocab).token_ids), cache

  def hf_export(self, context: HFExportContext) -> HFExport | None:
    """The heads in a serving system's format, beside a Hugging Face Llama export of the trunk.

    Returns:
      What to write (see `HFExport`), or None when the family has no such format (the export
      then names the family and refuses).
    """
    del context
    return None

  @classmethod
  def hf_import(cls, source: HFImportSource) -> HFImport | None:
    """The family's heads in a Hugging Face directory (`hf_export`'s format), or None when it
    holds none. Raises ValueError naming a file or tensor that does not fit."""
    del source
    return None


@flax.struct.dataclass
class DraftVocab:
  """A draft vocabulary (FR-Spec) ready for drafting: its ids and their output-layer rows.

  Gathered once (`gather_draft_vocab`) outside the decode loop's steps, so that drafting
  reads N rows instead of the whole [V, D] matrix and copies nothing per step.

  Attributes:
    ids: [N] int32 token ids.
    weights: the output layer at those ids in the compute dtype: [N, D] rows of a tied
      embedding, else [D, N] columns of the output matrix.
  """
  ids: Array
  weights: Array


def gather_draft_vocab(trunk: transformer.Transformer, ids: Array) -> DraftVocab:
  """`DraftVocab` of token ids [N] (inside jitted code)."""
  dtype = transformer.dtype_of(trunk.cfg.dtype)
  if trunk.cfg.tie_embeddings:
    weights = trunk.embed(ids)  # [N, D]: the tied output layer's rows are embeddings.
  else:
    weights = jnp.take(trunk.unembedding(), ids, axis=1)  # [D, N]
  return DraftVocab(ids=ids, weights=weights.astype(dtype))


class DraftProjection:
  """The output layer as drafting uses it: the whole vocabulary, or a draft vocabulary's N
  ids (FR-Spec) only.

  Inside jitted code. `logits(x)` maps [..., D] to float32 [..., N] (N = V without a draft
  vocabulary), `token_ids(index)` maps indices into those N back to token ids.
  """

  def __init__(self, trunk: transformer.Transformer, vocab: DraftVocab | Array | None = None):
    """vocab: a `DraftVocab`, token ids [N] (gathered here, once for every head), or None."""
    if vocab is not None and not isinstance(vocab, DraftVocab):
      vocab = gather_draft_vocab(trunk, vocab)
    self.trunk, self.vocab = trunk, vocab

  def logits(self, x: Array) -> Array:
    """Normalised features [..., D] -> float32 logits [..., N]."""
    if self.vocab is None:
      return self.trunk.logits(x)
    if self.trunk.cfg.tie_embeddings:
      return products.einsum('...d,nd->...n', x, self.vocab.weights,
                             preferred_element_type=jnp.float32)
    return products.einsum('...d,dn->...n', x, self.vocab.weights,
                           preferred_element_type=jnp.float32)

  def token_ids(self, index: Array) -> Array:
    """Indices into the N logits (any shape) -> token ids."""
    return index if self.vocab is None else jnp.take(self.vocab.ids, index, axis=0)


def causal_mask(t: int) -> np.ndarray:
  """[T, T] lower-triangular block mask (a chain of new tokens), a constant: attention then
  knows when tracing that every query reads its keys in order (`kv_cache.attend`)."""
  return np.tril(np.ones((t, t), bool))


def layer_cache(cache: kv_cache_lib.KVCache | None, layer: int):
  """(keys, values) of one cache layer, or None without a cache."""
  return None if cache is None else (cache.keys[layer], cache.values[layer])


# The registry: config name (`model.mtp_head_type`) -> family. Imported last: the family
# modules import the protocol above.
# pylint: disable-next=C0413
from mtp.model.heads import eagle, medusa, parallel, sequential, streaming  # noqa: E402

FAMILIES: dict[str, type[HeadFamily]] = {
    'eagle': eagle.EagleDrafter,
    'medusa': medusa.MedusaHeads,
    'parallel': parallel.ParallelHeads,
    'sequential': sequential.SequentialHeads,
    'streaming': streaming.StreamingHeads,
}


def family(name: str) -> type[HeadFamily]:
  """The family registered as `name`; ValueError naming the known ones otherwise."""
  if name not in FAMILIES:
    raise ValueError(f'Unknown model.mtp_head_type {name!r}; expected one of '
                     f'{", ".join(FAMILIES)}.')
  return FAMILIES[name]

