"""Tiny synthetic Llama checkpoints as GGUF files and Hugging Face directories, for fast tests.

Weights are random; GGUF files are written the way llama.cpp's converter writes them (q/k rows
permuted for interleaved rotary embeddings, tensors quantised block-wise along their rows).
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

from mtp.data import tokenizer as tokenizer_lib
from mtp.pretrained import gguf_file
from mtp.pretrained import gguf_tokenizer
from mtp.pretrained import llama

SHAPE = llama.LlamaShape(vocab_size=288, embed_dim=64, num_layers=2, num_attention_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=96, max_seq_len=128,
                         rope_theta=10_000.0, norm_eps=1e-5, tie_embeddings=True)
CONTROL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
SPECIAL_IDS = tokenizer_lib.SpecialIds(pad_id=2, eos_id=2, bos_id=1)  # As SmolLM2.
# A ChatML template like SmolLM2-Instruct's (shortened).
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_MERGES = ('Ġ t', 'h e', 'i n', 'Ġ Ġ', 'ĠĠ ĠĠ', 'Ġt he', 'd e', 'de f', 'r e', 'Ġ =', 'Ġ a',
           'o n', 'Ġ s', 'e r', 'a t', 'Ġ (', 'Ċ ĠĠĠĠ', 'ĊĠĠĠĠ ĠĠĠĠ')


def vocabulary() -> tuple[list[str], list[str], list[int]]:
  """(tokens, merges, token types) of a small byte-level BPE: control tokens, the 256 byte
  characters, then one token per merge."""
  tokens = [*CONTROL_TOKENS, *tokenizer_lib.byte_characters(),
            *(m.replace(' ', '') for m in _MERGES)]
  types = [gguf_tokenizer.CONTROL] * len(CONTROL_TOKENS) + [1] * (len(tokens) - 3)
  return tokens, list(_MERGES), types


def tokenizer() -> tokenizer_lib.Tokenizer:
  tokens, merges, types = vocabulary()
  return gguf_tokenizer.build(tokens, merges, types, 'smollm', SPECIAL_IDS)


def random_tensors(shape: llama.LlamaShape = SHAPE, seed: int = 0) -> dict[str, np.ndarray]:
  """Hugging Face name -> random float32 tensor (norm scales near 1), Hugging Face layout."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, dims in llama.expected_shapes(shape).items():
    if len(dims) == 1:
      out[name] = (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
    else:
      out[name] = (rng.standard_normal(dims) * dims[-1] ** -0.5).astype(np.float32)
  return out


def _heads(name: str, shape: llama.LlamaShape) -> int | None:
  if name.endswith('self_attn.q_proj.weight'):
    return shape.num_attention_heads
  if name.endswith('self_attn.k_proj.weight'):
    return shape.num_kv_heads
  return None


def write_gguf(path: pathlib.Path, tensors: dict[str, np.ndarray],
               shape: llama.LlamaShape = SHAPE, *, types: dict[str, str] | None = None,
               architecture: str = 'llama', omit: tuple[str, ...] = (),
               metadata: dict[str, Any] | None = None, num_tokens: int | None = None,
               tokenizer_model: str = 'gpt2', chat_template: str | None = None
               ) -> dict[str, np.ndarray]:
  """Writes a GGUF file as llama.cpp's converter would and returns what it stores.

  Args:
    tensors: Hugging Face name -> float32 values (Hugging Face layout).
    types: Hugging Face name -> GGML type name ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1',
      'I8', ...); default F32.
    omit: Hugging Face names left out.
    metadata: extra `llama.*` keys ('rope.scaling.type': 'linear', ...).
    num_tokens: vocabulary size written (default all of `vocabulary()`), padded with
      normal tokens.
    chat_template: written as `tokenizer.chat_template` if given.
  Returns:
    GGUF name -> the values as the file stores them, dequantised (still permuted).
  """
  import gguf
  from gguf import quants
  types = types or {}
  writer = gguf.GGUFWriter(str(path), architecture)
  writer.add_name('tiny test llama')
  writer.add_block_count(shape.num_layers)
  writer.add_context_length(shape.max_seq_len)
  writer.add_embedding_length(shape.embed_dim)
  writer.add_feed_forward_length(shape.mlp_dim)
  writer.add_head_count(shape.num_attention_heads)
  writer.add_head_count_kv(shape.num_kv_heads)
  writer.add_rope_freq_base(shape.rope_theta)
  writer.add_layer_norm_rms_eps(shape.norm_eps)
  writer.add_rope_dimension_count(shape.head_dim)
  for key, value in (metadata or {}).items():
    if isinstance(value, str):
      writer.add_string(f'{architecture}.{key}', value)
    else:
      writer.add_float32(f'{architecture}.{key}', value)
  tokens, merges, token_types = vocabulary()
  if num_tokens is not None:
    extra = num_tokens - len(tokens)
    tokens += [f'x{i}' for i in range(extra)]
    token_types += [1] * extra
  writer.add_tokenizer_model(tokenizer_model)
  writer.add_tokenizer_pre('smollm')
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(token_types)
  writer.add_bos_token_id(SPECIAL_IDS.bos_id)
  writer.add_eos_token_id(SPECIAL_IDS.eos_id)
  writer.add_pad_token_id(SPECIAL_IDS.pad_id)
  if chat_template is not None:
    writer.add_chat_template(chat_template)
  names = gguf_file.gguf_names(shape.num_layers)
  stored = {}
  for name, values in tensors.items():
    if name in omit:
      continue
    heads = _heads(name, shape)
    if heads is not None:
      values = llama.permute_rotary_rows(values, heads)
    kind = types.get(name, 'F32')
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == 'F32':
      data = values.astype(np.float32)
      writer.add_tensor(names[name], data)
    elif kind == 'F16':
      data = values.astype(np.float16)
      writer.add_tensor(names[name], data)
    elif kind == 'I8':
      data = np.clip(np.round(values * 64), -127, 127).astype(np.int8)
      writer.add_tensor(names[name], data)
    else:
      data = quants.quantize(values.astype(np.float32), qtype)
      writer.add_tensor(names[name], data, raw_dtype=qtype)
    if kind != 'I8':
      stored[names[name]] = np.asarray(quants.dequantize(data, qtype), np.float32).reshape(
          values.shape)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return stored


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  """A safetensors file (any of float32, float16, bfloat16 arrays), written by hand."""
  names = {np.dtype(np.float32): 'F32', np.dtype(np.float16): 'F16',
           np.dtype(ml_dtypes.bfloat16): 'BF16'}
  header, offset, blobs = {}, 0, []
  for name, values in tensors.items():
    blob = np.ascontiguousarray(values).tobytes()
    header[name] = {'dtype': names[values.dtype], 'shape': list(values.shape),
                    'data_offsets': [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  raw = json.dumps(header).encode('utf-8')
  raw += b' ' * (-len(raw) % 8)
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(raw)) + raw)
    for blob in blobs:
      f.write(blob)


def write_hf_directory(directory: pathlib.Path, tensors: dict[str, np.ndarray],
                       shape: llama.LlamaShape = SHAPE, *, dtype: Any = np.float32,
                       num_shards: int = 1, config: dict[str, Any] | None = None,
                       omit: tuple[str, ...] = (),
                       tokenizer_config: dict[str, Any] | None = None) -> pathlib.Path:
  """A Hugging Face model directory: config.json, tokenizer files, safetensors (sharded if
  num_shards > 1), with `config` overriding config.json entries; `tokenizer_config.json` holds
  `tokenizer_config` if given."""
  directory.mkdir(parents=True, exist_ok=True)
  cfg = {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'vocab_size': shape.vocab_size, 'hidden_size': shape.embed_dim,
      'num_hidden_layers': shape.num_layers, 'num_attention_heads': shape.num_attention_heads,
      'num_key_value_heads': shape.num_kv_heads, 'head_dim': shape.head_dim,
      'intermediate_size': shape.mlp_dim, 'max_position_embeddings': shape.max_seq_len,
      'rope_theta': shape.rope_theta, 'rms_norm_eps': shape.norm_eps,
      'tie_word_embeddings': shape.tie_embeddings, 'hidden_act': 'silu',
      'rope_scaling': None, 'bos_token_id': SPECIAL_IDS.bos_id, 'eos_token_id': SPECIAL_IDS.eos_id,
  }
  cfg.update(config or {})
  (directory / 'config.json').write_text(json.dumps(cfg))
  (directory / 'generation_config.json').write_text(json.dumps(
      {'bos_token_id': SPECIAL_IDS.bos_id, 'eos_token_id': [SPECIAL_IDS.eos_id],
       'pad_token_id': SPECIAL_IDS.pad_id}))
  (directory / 'tokenizer.json').write_text(tokenizer().to_json())
  if tokenizer_config is not None:
    (directory / 'tokenizer_config.json').write_text(json.dumps(tokenizer_config))
  kept = {k: v.astype(dtype) for k, v in tensors.items() if k not in omit}
  if num_shards == 1:
    write_safetensors(directory / 'model.safetensors', kept)
    return directory
  names = sorted(kept)
  weight_map = {}
  for shard in range(num_shards):
    file = f'model-{shard + 1:05d}-of-{num_shards:05d}.safetensors'
    part = names[shard::num_shards]
    write_safetensors(directory / file, {k: kept[k] for k in part})
    weight_map.update({k: file for k in part})
  (directory / 'model.safetensors.index.json').write_text(json.dumps(
      {'metadata': {}, 'weight_map': weight_map}))
  return directory
