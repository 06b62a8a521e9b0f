"""The decode loop's parts: prompt layout, the prepared model, the result.

Prompts are right-padded [B, P] with per-row lengths [B]. Every row keeps its own committed
cache length, and cache slot s of a row always holds that row's position s, so a row's next
token sits at position == slot == its committed length.

Everything that runs inside the decode loop here is a pure jnp function. Requests are checked
before they get here (`request.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.decode import finish
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import transformer
from mtp.parallel import mesh as mesh_lib

Array = jax.Array


@dataclasses.dataclass
class DecodeResult:
  """Generated tokens and per-row statistics, on the host (numpy arrays).

  Attributes:
    tokens: [B, max_new_tokens] int32 generated tokens (stop id included), `pad_id` after the
      end.
    num_generated: [B] int32 tokens generated per row.
    num_steps: [B] int32 forward passes of the decode loop that worked on the row (the prefill,
      which yields the first token, is not counted).
    accepted_histogram: [B, W] int32; entry j counts the loop steps that emitted j tokens for
      the row (accepted drafts plus the trunk's own token, after cutting at a stop id and the
      row's budget). W = 2 for autoregressive decoding, block depth + 2 when drafting.
    reason: [B] int32 why each row stopped (`finish.py`), RUNNING while it runs.
    logprobs: [B, max_new_tokens] float32 the model's log-probability of each token ([B, 0]
      when the plan keeps none); top_ids, top_logprobs: [B, max_new_tokens, K] its K most
      likely tokens at each position and theirs.
  """
  tokens: np.ndarray
  num_generated: np.ndarray
  num_steps: np.ndarray
  accepted_histogram: np.ndarray
  reason: np.ndarray = None
  logprobs: np.ndarray = None
  top_ids: np.ndarray = None
  top_logprobs: np.ndarray = None

  @property
  def mean_accepted(self) -> np.ndarray:
    """[B] float32 tokens emitted per loop step (0 for a row that needed no loop step)."""
    counts = np.arange(self.accepted_histogram.shape[-1], dtype=np.float32)
    emitted = np.sum(np.asarray(self.accepted_histogram) * counts, axis=-1)
    return emitted / np.maximum(np.asarray(self.num_steps), 1).astype(np.float32)

  @property
  def done(self) -> np.ndarray:
    """[B] rows that have stopped."""
    return np.asarray(self.reason) != finish.RUNNING

  def finish_reason(self, row: int) -> str | None:
    return finish.finish_reason(self.reason[row])


class _Structure:
  """The static part of a split model, as a jit static argument whose hash is computed once.

  Hashing an NNX GraphDef costs about a millisecond per call for a small model.
  """

  def __init__(self, graphdef, treedef):
    self.graphdef, self.treedef = graphdef, treedef
    self._hash = hash((graphdef, treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, _Structure) and self._hash == other._hash and
                             self.graphdef == other.graphdef and self.treedef == other.treedef)


class PreparedModel:
  """A model split once for decoding (`nnx.split` outside the compiled code, merged inside).

  Decoders accept it wherever they accept a model. Reusing it across calls skips the graph
  traversal that splitting costs (milliseconds per call). It holds the weights as they were
  when prepared: prepare again after changing them.

  On CPU, with every weight on one device, it holds `cpu_decoding_copy(model)`: q, k and v,
  and gate and up, each read by one matmul (faster there; measured in
  `benchmarks.fused_projections`), and the norms' scales in float32. Every decoder then decodes
  with the same copy, so they stay exact against each other; outputs can differ from the
  unfused model's in the last bits.

  Attributes:
    cfg: the model's `ModelConfig`.
    structure: static (hashable) graph and parameter tree structure.
    leaves: the parameter arrays.
    fused: whether the projections are fused.
  """

  def __init__(self, model, fuse: bool | None = None):
    if fuse is None:
      fuse = fuse_by_default(model)
    self.fused = bool(fuse)
    if self.fused:
      model = cpu_decoding_copy(model)
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    self.cfg = model.cfg
    self.structure = _Structure(graphdef, treedef)
    self.leaves = leaves

  @property
  def mtp_num_heads(self) -> int:
    return self.cfg.mtp_num_heads


def prepare(model, fuse: bool | None = None) -> PreparedModel:
  """`PreparedModel(model, fuse)`, or `model` itself if it is already prepared."""
  return model if isinstance(model, PreparedModel) else PreparedModel(model, fuse)


def cpu_decoding_copy(model):
  """The copy of `model` decoding runs on CPU: `transformer.fused_projections`, with
  `transformer.float32_norm_scales` (fewer arrays carried through the decoding loop)."""
  return transformer.float32_norm_scales(transformer.fused_projections(model))


def fuse_by_default(model) -> bool:
  """Whether decoding fuses the model's projections: on CPU, with every weight a concrete
  array on one device (a sharded weight would be gathered to concatenate it; traced weights,
  as in an export for other platforms, keep the model's own layout)."""
  leaves = jax.tree.leaves(nnx.state(model))
  return (jax.default_backend() == 'cpu'
          and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
          and all(len(leaf.sharding.device_set) == 1 for leaf in leaves
                  if isinstance(leaf, jax.Array)))


def merge(structure: _Structure, leaves):
  """Inside jitted code: the model back from `PreparedModel.structure` and `.leaves`."""
  return nnx.merge(structure.graphdef, jax.tree.unflatten(structure.treedef, leaves))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0,
                multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists into ([B, P] int32, lengths [B] int32).

  Args:
    prompts: one list of token ids per row (at least one row).
    pad_id: filler after each row's end (never attended to).
    multiple: P is rounded up to a multiple of this, so nearby prompt lengths share a compiled
      decoder.
  """
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = max(1, int(lengths.max()))
  width = -(-width // multiple) * multiple
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = np.asarray(prompt, np.int32)
  return tokens, lengths


def as_key(rng) -> Array:
  """A PRNG key from an int seed, a key, or None (seed 0)."""
  if rng is None:
    rng = 0
  if isinstance(rng, (int, np.integer)):
    return jax.random.key(int(rng))
  return rng


def shard_rows(arrays: Sequence[Array], mesh: jax.sharding.Mesh | None) -> tuple[Array, ...]:
  """Places [B, ...] arrays with their rows over the mesh's batch axes (None: as they are).

  A batch that the batch axes do not divide stays replicated.
  """
  if mesh is None:
    return tuple(arrays)
  return tuple(jax.device_put(a, jax.sharding.NamedSharding(mesh, mesh_lib.logical_to_mesh_spec(
      ('batch',) + (None,) * (a.ndim - 1), a.shape, mesh))) for a in arrays)


def shard_cache(cache: kv_cache_lib.KVCache,
                mesh: jax.sharding.Mesh | None) -> kv_cache_lib.KVCache:
  """Inside jitted code: keeps a cache's rows over the batch axes and KV heads over 'tensor'.

  Every loop step then reads and writes each device's shard of the cache in place.
  """
  if mesh is None:
    return cache

  def constrain(buffer):  # [B, G, S, H]
    spec = mesh_lib.logical_to_mesh_spec(('batch', 'kv_heads', None, None), buffer.shape, mesh)
    return jax.lax.with_sharding_constraint(buffer, jax.sharding.NamedSharding(mesh, spec))
  return jax.tree.map(constrain, cache)
