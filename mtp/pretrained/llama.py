"""Llama-architecture weights in one neutral form, and their mapping onto the mtp trunk.

Both readers (`gguf_file`, `hf_directory`) produce a `Checkpoint`: the hyper-parameters
(`LlamaShape`) and float32 numpy tensors under the Hugging Face names, in the Hugging Face layout:
linear weights are [out, in] and the rows of q_proj/k_proj follow the half-split rotary layout that
`transformer.rotary_embedding` uses. `to_params` checks every tensor against the shape and returns
the pure-dict parameter tree of an `MTPModel` with no heads; `from_params` and `block_tensors` go
the other way (the Hugging Face export, `mtp.export.hf`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import numpy as np

from mtp.data import tokenizer as tokenizer_lib


class PretrainedError(ValueError):
  """Pretrained weights that cannot be imported; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True)
class LlamaShape:
  """The hyper-parameters that define a Llama trunk (names follow `config.model`)."""
  vocab_size: int  # rows of the embedding
  embed_dim: int
  num_layers: int
  num_attention_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float
  norm_eps: float
  tie_embeddings: bool

  def validate(self, source: str) -> None:
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type in ('int', 'float') and not value > 0:
        raise PretrainedError(f'{source}: {field.name} must be positive, got {value}.')
    if self.num_attention_heads % self.num_kv_heads:
      raise PretrainedError(f'{source}: {self.num_attention_heads} attention heads are not a '
                            f'multiple of {self.num_kv_heads} key/value heads.')
    if self.head_dim % 2:
      raise PretrainedError(f'{source}: head_dim {self.head_dim} is odd; rotary embeddings need '
                            'an even head_dim.')

  def model_config(self) -> dict[str, Any]:
    """The `config.model` entries of a trunk of this shape (no multi-token heads)."""
    return {**dataclasses.asdict(self), 'mtp_num_heads': 0}


@dataclasses.dataclass
class Checkpoint:
  """Everything an import needs, read and checked, nothing written yet.

  Attributes:
    shape: the trunk's hyper-parameters.
    tensors: Hugging Face name -> float32 array (see module doc).
    tokenizer: the model's tokenizer with its special ids.
    source: provenance for the workdir's config (path, format, file digests, model name).
    file_names: Hugging Face name -> the name in the source file, where they differ (messages).
    heads: multi-token heads found beside the trunk, as (family name, `heads.HFImport`), or None.
  """
  shape: LlamaShape
  tensors: dict[str, np.ndarray]
  tokenizer: tokenizer_lib.Tokenizer
  source: dict[str, Any]
  file_names: dict[str, str] = dataclasses.field(default_factory=dict)
  heads: Any = None

  def file_name(self, name: str) -> str:
    return self.file_names.get(name, name)


def layer_names(i: int) -> dict[str, str]:
  """Our name inside block i -> the Hugging Face tensor name."""
  prefix = f'model.layers.{i}.'
  return {
      'attn_norm': prefix + 'input_layernorm.weight',
      'q_proj': prefix + 'self_attn.q_proj.weight',
      'k_proj': prefix + 'self_attn.k_proj.weight',
      'v_proj': prefix + 'self_attn.v_proj.weight',
      'o_proj': prefix + 'self_attn.o_proj.weight',
      'mlp_norm': prefix + 'post_attention_layernorm.weight',
      'gate': prefix + 'mlp.gate_proj.weight',
      'up': prefix + 'mlp.up_proj.weight',
      'down': prefix + 'mlp.down_proj.weight',
  }


_LAYER_INDEX = re.compile(r'model\.layers\.(\d+)\.')


def layer_index(name: str) -> int | None:
  """i of a Hugging Face name under `model.layers.{i}.`, else None."""
  match = _LAYER_INDEX.match(name)
  return int(match.group(1)) if match else None


EMBED, FINAL_NORM, LM_HEAD = 'model.embed_tokens.weight', 'model.norm.weight', 'lm_head.weight'
# Buffers some checkpoints carry that hold nothing the trunk needs (recomputed from rope_theta).
_IGNORED = re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq')


def expected_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
  """Hugging Face name -> [out, in] (or [features]) for every tensor of a trunk of `shape`."""
  d, kv = shape.embed_dim, shape.num_kv_heads * shape.head_dim
  q = shape.num_attention_heads * shape.head_dim
  per_layer = {'attn_norm': (d,), 'q_proj': (q, d), 'k_proj': (kv, d), 'v_proj': (kv, d),
               'o_proj': (d, q), 'mlp_norm': (d,), 'gate': (shape.mlp_dim, d),
               'up': (shape.mlp_dim, d), 'down': (d, shape.mlp_dim)}
  out = {EMBED: (shape.vocab_size, d), FINAL_NORM: (d,)}
  if not shape.tie_embeddings:
    out[LM_HEAD] = (shape.vocab_size, d)
  for i in range(shape.num_layers):
    out.update({name: per_layer[ours] for ours, name in layer_names(i).items()})
  return out


def check(checkpoint: Checkpoint, source: str) -> None:
  """Raises PretrainedError naming the first missing, unexpected or misshapen tensor, or a
  tokenizer with more ids than the embedding has rows."""
  shape = checkpoint.shape
  shape.validate(source)
  expected = expected_shapes(shape)
  name_of = checkpoint.file_name
  missing = [name for name in expected if name not in checkpoint.tensors]
  if missing:
    more = f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''
    raise PretrainedError(f'{source}: missing tensor {name_of(missing[0])}{more}.')
  unexpected = [name for name in checkpoint.tensors
                if name not in expected and not _IGNORED.fullmatch(name)]
  if unexpected:
    raise PretrainedError(f'{source}: unexpected tensor {name_of(unexpected[0])} for a Llama '
                          f'trunk of {shape.num_layers} layers; other architectures are not '
                          'supported.')
  for name, want in expected.items():
    got = tuple(checkpoint.tensors[name].shape)
    if got != want:
      raise PretrainedError(f'{source}: tensor {name_of(name)} has shape {list(got)}, expected '
                            f"{list(want)} from the model's hyper-parameters.")
  tokens = checkpoint.tokenizer.vocab_size
  if tokens > shape.vocab_size:
    raise PretrainedError(f'{source}: the tokenizer has {tokens} ids but the embedding has only '
                          f'{shape.vocab_size} rows.')


def to_params(checkpoint: Checkpoint) -> dict[str, Any]:
  """The `nnx.to_pure_dict` tree of `MTPModel` (no heads) holding the checkpoint's weights.

  nnx.Linear kernels are [in, out], so every Hugging Face [out, in] weight is transposed.
  Call `check` first.
  """
  t = checkpoint.tensors
  blocks = {i: block_params(t, i) for i in range(checkpoint.shape.num_layers)}
  trunk = {'embedding': {'embedding': t[EMBED]}, 'blocks': blocks,
           'final_norm': {'scale': t[FINAL_NORM]}}
  if not checkpoint.shape.tie_embeddings:
    trunk['output'] = t[LM_HEAD].T
  return {'trunk': trunk}


def block_params(tensors: Mapping[str, np.ndarray], i: int) -> dict[str, Any]:
  """The pure-dict parameters of a trunk block (kernels [in, out]) from Llama layer i's Hugging
  Face tensors in `tensors`."""
  n = layer_names(i)
  return {
      'attn_norm': {'scale': tensors[n['attn_norm']]},
      'attn': {name: {'kernel': tensors[n[name]].T} for name in ('q_proj', 'k_proj', 'v_proj',
                                                                  'o_proj')},
      'mlp_norm': {'scale': tensors[n['mlp_norm']]},
      'mlp': {name: {'kernel': tensors[n[name]].T} for name in ('gate', 'up', 'down')},
  }


def block_tensors(block: Mapping[str, Any], i: int) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of a trunk block as Llama layer i: `to_params`' inverse.

  Args:
    block: the block's pure-dict parameters (`attn_norm`, `attn`, `mlp_norm`, `mlp`; kernels
      [in, out]).
  Returns:
    Hugging Face name -> float32 array ([out, in] weights), in `layer_names` order.
  """
  groups = {'attn_norm': block['attn_norm'], 'mlp_norm': block['mlp_norm'],
            **block['attn'], **block['mlp']}
  out = {}
  for ours, name in layer_names(i).items():
    values = groups[ours]
    out[name] = np.asarray(values['scale'] if 'scale' in values else values['kernel'].T,
                           np.float32)
  return out


def from_params(params: Mapping[str, Any], tie_embeddings: bool) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of a trunk: `to_params`' inverse.

  Args:
    params: `nnx.to_pure_dict` of an `MTPModel` (its `trunk` entry is read) or of its trunk.
    tie_embeddings: whether the output layer is the embedding (then no `lm_head.weight`).
  Returns:
    Hugging Face name -> float32 array: the embedding, the blocks in order, the final norm, and
    the output layer [V, D] when untied.
  """
  trunk = params.get('trunk', params)
  out = {EMBED: np.asarray(trunk['embedding']['embedding'], np.float32)}
  for i in sorted(trunk['blocks'], key=int):
    out.update(block_tensors(trunk['blocks'][i], int(i)))
  out[FINAL_NORM] = np.asarray(trunk['final_norm']['scale'], np.float32)
  if not tie_embeddings:
    out[LM_HEAD] = np.asarray(trunk['output'], np.float32).T
  return out


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's reordering of q/k rows for its interleaved rotary embedding.

  Within each head llama.cpp stores the rows as [head_dim/2, 2] pairs (feature i next to
  feature i + head_dim/2); the half-split layout wants them as [2, head_dim/2].

  Args:
    weight: [num_heads * head_dim, in] as stored in the GGUF file.
  Returns:
    The same rows in Hugging Face order.
  """
  rows, cols = weight.shape
  head_dim = rows // num_heads
  return (weight.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2)
          .reshape(rows, cols))


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """The inverse of `unpermute_rotary_rows` (what llama.cpp's converter does); for tests."""
  rows, cols = weight.shape
  head_dim = rows // num_heads
  return (weight.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2)
          .reshape(rows, cols))
