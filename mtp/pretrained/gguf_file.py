"""Reads a llama.cpp GGUF file of a Llama-architecture model into a `llama.Checkpoint`.

Tensors are dequantised to float32 with the `gguf` package (F32, F16, BF16, Q4_0, Q4_1, Q8_0,
the K-quants and others it implements). GGUF lists shapes innermost first; the reader's arrays
are already [out, in] like Hugging Face's. llama.cpp's converter reorders the rows of attn_q and
attn_k for its interleaved rotary embedding; they are put back in the half-split order here.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np

from mtp.pretrained import gguf_tokenizer
from mtp.pretrained import llama
from mtp.pretrained.llama import PretrainedError

ARCHITECTURE = 'llama'
# GGUF tensor name inside block i -> our name inside the block (see `llama.layer_names`).
_LAYER_TENSORS = {
    'attn_norm': 'attn_norm', 'attn_q': 'q_proj', 'attn_k': 'k_proj', 'attn_v': 'v_proj',
    'attn_output': 'o_proj', 'ffn_norm': 'mlp_norm', 'ffn_gate': 'gate', 'ffn_up': 'up',
    'ffn_down': 'down',
}
_GLOBAL_TENSORS = {'token_embd.weight': llama.EMBED, 'output_norm.weight': llama.FINAL_NORM,
                   'output.weight': llama.LM_HEAD}
_LAYER_NAME = re.compile(r'blk\.(\d+)\.(\w+)\.weight')


def open_reader(path: pathlib.Path):
  """A `gguf.GGUFReader`, or PretrainedError naming the file when it cannot be parsed."""
  import gguf  # Imported here: reading metadata is all most callers of this package need.
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # The reader raises many types on truncated or foreign files.
    raise PretrainedError(f'{path} is not a readable GGUF file (truncated or corrupt?): '
                          f'{type(e).__name__}: {e}') from e


def metadata(reader, key: str, default: Any = None, *, path: pathlib.Path) -> Any:
  """The value of metadata `key` (str, int, float, bool or a list of them)."""
  field = reader.fields.get(key)
  if field is None:
    if default is None:
      raise PretrainedError(f'{path}: metadata {key} is missing.')
    return default
  return field.contents()


def read_shape(reader, path: pathlib.Path) -> llama.LlamaShape:
  """The trunk's hyper-parameters from the `llama.*` metadata (and the embedding's rows)."""
  arch = metadata(reader, 'general.architecture', path=path)
  if arch != ARCHITECTURE:
    raise PretrainedError(f'{path}: architecture {arch!r} is not supported; only '
                          f'{ARCHITECTURE!r} (Llama-style trunks) can be imported.')

  def get(key, default=None):
    return metadata(reader, f'{ARCHITECTURE}.{key}', default, path=path)

  if get('expert_count', 0):
    raise PretrainedError(f'{path}: a mixture of experts ({get("expert_count")} experts) is not '
                          'supported.')
  scaling = get('rope.scaling.type', 'none')
  if scaling != 'none':
    raise PretrainedError(f'{path}: rope scaling {scaling!r} is not supported (the trunk uses '
                          'plain rotary embeddings).')
  num_heads = int(get('attention.head_count'))
  embed_dim = int(get('embedding_length'))
  head_dim = int(get('attention.key_length', embed_dim // max(num_heads, 1)))
  if int(get('attention.value_length', head_dim)) != head_dim:
    raise PretrainedError(f'{path}: keys and values of different sizes are not supported.')
  if int(get('rope.dimension_count', head_dim)) != head_dim:
    raise PretrainedError(f'{path}: rotary embeddings on {get("rope.dimension_count")} of '
                          f'{head_dim} features per head are not supported.')
  embed = _tensor_info(reader).get('token_embd.weight')
  if embed is None:
    raise PretrainedError(f'{path}: missing tensor token_embd.weight.')
  return llama.LlamaShape(
      vocab_size=int(embed.shape[-1]), embed_dim=embed_dim,
      num_layers=int(get('block_count')), num_attention_heads=num_heads,
      num_kv_heads=int(get('attention.head_count_kv', num_heads)), head_dim=head_dim,
      mlp_dim=int(get('feed_forward_length')), max_seq_len=int(get('context_length')),
      rope_theta=float(get('rope.freq_base', 10_000.0)),
      norm_eps=float(get('attention.layer_norm_rms_epsilon')),
      tie_embeddings='output.weight' not in _tensor_info(reader))


def _tensor_info(reader) -> dict[str, Any]:
  return {t.name: t for t in reader.tensors}


def gguf_names(num_layers: int) -> dict[str, str]:
  """Hugging Face name -> GGUF name of every tensor a Llama trunk may have (for messages)."""
  names = {hf: gguf for gguf, hf in _GLOBAL_TENSORS.items()}
  for i in range(num_layers):
    block = llama.layer_names(i)
    names.update({block[ours]: f'blk.{i}.{g}.weight' for g, ours in _LAYER_TENSORS.items()})
  return names


def hf_name(gguf_name: str) -> tuple[str, str] | None:
  """(Hugging Face name, our name within a block or '') of a GGUF tensor; None for names a Llama
  trunk does not have."""
  if gguf_name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[gguf_name], ''
  match = _LAYER_NAME.fullmatch(gguf_name)
  if match and match.group(2) in _LAYER_TENSORS:
    ours = _LAYER_TENSORS[match.group(2)]
    return llama.layer_names(int(match.group(1)))[ours], ours
  return None


def dequantize(tensor, path: pathlib.Path) -> np.ndarray:
  """A reader tensor as a float32 array of its logical shape ([out, in] for matrices)."""
  from gguf import quants
  try:
    values = quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError as e:
    raise PretrainedError(f'{path}: tensor {tensor.name} is stored as '
                          f'{tensor.tensor_type.name}, which the gguf package cannot dequantise '
                          f'({e}).') from e
  shape = tuple(int(n) for n in reversed(tensor.shape))
  return np.array(values, np.float32).reshape(shape)  # A copy: the file may be closed later.


def read(path: str | pathlib.Path) -> llama.Checkpoint:
  """Reads and checks a GGUF file: hyper-parameters, float32 tensors, tokenizer.

  Raises:
    PretrainedError: naming the file and what is wrong (architecture, tensor type, missing or
      misshapen tensor, tokenizer, truncated file).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise PretrainedError(f'{path} does not exist.')
  reader = open_reader(path)
  shape = read_shape(reader, path)
  tokenizer = gguf_tokenizer.from_gguf(reader, path)
  tensors = {}
  for tensor in reader.tensors:
    names = hf_name(tensor.name)
    if names is None:
      raise PretrainedError(f'{path}: unexpected tensor {tensor.name} for a Llama trunk (rotary '
                            'frequency factors, biases and other architectures are not supported).')
    name, ours = names
    values = dequantize(tensor, path)
    if ours in ('q_proj', 'k_proj'):
      heads = shape.num_attention_heads if ours == 'q_proj' else shape.num_kv_heads
      if values.ndim != 2 or values.shape[0] != heads * shape.head_dim:
        raise PretrainedError(f'{path}: tensor {tensor.name} has shape {list(values.shape)}, '
                              f'expected [{heads * shape.head_dim}, {shape.embed_dim}] from the '
                              "model's hyper-parameters.")
      values = llama.unpermute_rotary_rows(values, heads)
    tensors[name] = values
  checkpoint = llama.Checkpoint(shape=shape, tensors=tensors, tokenizer=tokenizer,
                                source={'format': 'gguf', 'path': str(path.absolute()),
                                        'name': metadata(reader, 'general.name', '', path=path),
                                        'files': [str(path.absolute())]},
                                file_names=gguf_names(shape.num_layers))
  llama.check(checkpoint, str(path))
  return checkpoint

