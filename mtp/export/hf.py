"""The Hugging Face export (`--format=hf`): a Llama directory, the heads in their serving formats.

`write(loaded, directory, dtype)` fills an existing empty directory (the caller stages and renames
it) with:
  * `config.json`: `LlamaForCausalLM` of the trunk's shape (rope theta, RMS eps, tied or untied
    embeddings, bos/eos/pad ids, dtype), plus whatever the head family adds;
  * `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` once the weights pass `max_shard_bytes`. Names, layouts and
    the half-split rotary row order are Hugging Face Llama's (`mtp.pretrained.llama`, the
    importer's mapping, run backwards), so `import_weights` reads the trunk back bit for bit;
  * `tokenizer.json`, and `tokenizer_config.json` for `PreTrainedTokenizerFast` with the special
    tokens and no BOS/EOS added (mtp adds none), so `AutoTokenizer.from_pretrained(DIR)` gives
    mtp's ids and decodes them back;
  * `generation_config.json` with the special ids, and `suppress_tokens` listing what mtp's
    decoders never emit (output ids past the tokenizer's vocabulary, and pad when it is not eos),
    so transformers' greedy `generate` gives mtp's tokens;
  * the chat template, when the tokenizer has one, in `tokenizer_config.json` and as
    `chat_template.jinja`.

Special-token strings in text: mtp encodes them as ordinary text. A tokenizer without a chat
template is exported the same way (`split_special_tokens`). With a chat template, Hugging Face's
default is kept: the template's markers (`<|im_start|>` ...) must be read as special tokens, so
text that spells a special token literally is the one place where AutoTokenizer and mtp differ.

Heads go through their family's `hf_export` hook (`mtp.model.heads.HFExport`): Medusa heads to
`medusa/` in vLLM's Medusa format, sequential (DeepSeek-V3) modules as MTP layers L.. of the Llama
directory, parallel heads to `parallel_heads/`, EAGLE to `eagle/`, Speculative Streaming's stream
embeddings and adapters to `speculative_streaming/`; see each family's module. A family without a
format, or a dtype the format cannot hold, raises `ExportError` before anything is written.
`import_weights` reads the whole export back, heads included (`HeadFamily.hf_import`).

Consumers: transformers loads the Llama directory (extra MTP layers are ignored with a warning);
vLLM serves it with Medusa heads as its speculative model (`medusa/`); vLLM's Llama loader
refuses unknown tensor names, so it cannot serve a directory that holds sequential MTP layers.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import numpy as safetensors_numpy

from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import draft_vocab
from mtp.export import ExportError
from mtp.model import heads as heads_lib
from mtp.model import transformer
from mtp.pretrained import llama

# The dtypes a Hugging Face Llama checkpoint holds (safetensors F32 / BF16 / F16).
DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
          'float16': np.dtype(np.float16)}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # 5 GB files, the Hugging Face Hub's customary shard size.
WEIGHTS, INDEX = 'model.safetensors', 'model.safetensors.index.json'
CHAT_TEMPLATE = 'chat_template.jinja'


def check_dtype(dtype: Any) -> np.dtype:
  """`dtype` as a numpy dtype the format holds; ExportError otherwise."""
  try:
    name = np.dtype(dtype).name
  except TypeError:
    name = str(dtype)
  if name not in DTYPES:
    raise ExportError(f'the hf format holds {", ".join(DTYPES)} weights, not {name}.')
  return DTYPES[name]


def cast(tensors: dict[str, np.ndarray], dtype: np.dtype) -> dict[str, np.ndarray]:
  """Contiguous copies in `dtype`; ExportError naming a tensor whose values do not fit.

  Entries holding the same array (the shared output layer, once per head) share one copy.
  Integer and boolean tensors (an EAGLE-3 drafter's d2t and t2d) keep their dtype.
  """
  out, done = {}, {}
  for name, values in tensors.items():
    if not np.issubdtype(np.asarray(values).dtype, np.floating):
      out[name] = np.ascontiguousarray(values)
      continue
    if id(values) not in done:
      with np.errstate(over='ignore'):  # Overflow is checked for below, and named.
        converted = np.ascontiguousarray(values, dtype)
      if not np.all(np.isfinite(converted)) and np.all(np.isfinite(values)):
        raise ExportError(f'tensor {name} does not fit in {dtype.name}: its largest magnitude '
                          f'is {float(np.max(np.abs(values))):.3g}; export as float32 or '
                          'bfloat16.')
      done[id(values)] = converted
    out[name] = done[id(values)]
  return out


def shard(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
  """Tensors in order, cut into consecutive groups of at most `max_shard_bytes` each (a larger
  tensor alone in its group)."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, values in tensors.items():
    if shards[-1] and size + values.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = values
    size += values.nbytes
  return shards


def write_weights(directory: pathlib.Path, tensors: dict[str, np.ndarray],
                  max_shard_bytes: int) -> list[str]:
  """`model.safetensors`, or shards and their index above `max_shard_bytes`; the file names."""
  shards = shard(tensors, max_shard_bytes)
  metadata = {'format': 'pt'}  # transformers refuses safetensors files without it.
  if len(shards) == 1:
    safetensors_numpy.save_file(tensors, directory / WEIGHTS, metadata=metadata)
    return [WEIGHTS]
  names, weight_map = [], {}
  for i, part in enumerate(shards):
    name = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    safetensors_numpy.save_file(part, directory / name, metadata=metadata)
    weight_map.update({tensor: name for tensor in part})
    names.append(name)
  index = {'metadata': {'total_size': sum(v.nbytes for v in tensors.values())},
           'weight_map': weight_map}
  write_json(directory / INDEX, index)
  return names + [INDEX]


def write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
  path.write_text(json.dumps(value, indent=2) + '\n', encoding='utf-8')


def llama_config(cfg: transformer.TransformerConfig, special, dtype: np.dtype) -> dict[str, Any]:
  """config.json of a `LlamaForCausalLM` of the trunk's shape."""
  return {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'vocab_size': cfg.vocab_size, 'hidden_size': cfg.embed_dim,
      'intermediate_size': cfg.mlp_dim, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_attention_heads, 'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim, 'max_position_embeddings': cfg.max_seq_len,
      'rms_norm_eps': cfg.norm_eps, 'hidden_act': 'silu', 'attention_bias': False,
      'attention_dropout': 0.0, 'mlp_bias': False, 'tie_word_embeddings': cfg.tie_embeddings,
      # transformers < 5 reads rope_theta, >= 5 rope_parameters: both, the same theta.
      'rope_theta': cfg.rope_theta, 'rope_scaling': None,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
      'bos_token_id': special.bos_id, 'eos_token_id': special.eos_id,
      'pad_token_id': special.pad_id, 'torch_dtype': dtype.name, 'use_cache': True,
  }


def suppressed_ids(tokenizer, vocab_size: int) -> list[int]:
  """Ids mtp's decoders never emit (`data.tokenizer.emittable`, the one rule): the pad id
  unless it doubles as eos, and output rows past the tokenizer's vocabulary."""
  limit, banned = tokenizer_lib.emittable(tokenizer, vocab_size)
  return list(banned) + list(range(vocab_size if limit is None else limit, vocab_size))


def tokenizer_config(tokenizer, max_seq_len: int) -> dict[str, Any]:
  """tokenizer_config.json: tokenizer.json as it is, no BOS/EOS added, special tokens named."""
  token = tokenizer.hf_tokenizer.id_to_token
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'bos_token': token(tokenizer.bos_id), 'eos_token': token(tokenizer.eos_id),
      'pad_token': token(tokenizer.pad_id), 'add_bos_token': False, 'add_eos_token': False,
      # Decoding must give back the text: no space clean-up before punctuation.
      'clean_up_tokenization_spaces': False, 'model_max_length': max_seq_len,
      # mtp encodes special-token strings as text; a chat template needs them special (module doc).
      'split_special_tokens': tokenizer.chat_template is None,
  }
  if tokenizer.chat_template is not None:
    config['chat_template'] = tokenizer.chat_template
  return config


def _no_format(family_name: str) -> ExportError:
  return ExportError(f'the hf format cannot carry head family {family_name!r}: it has no '
                     'serving format; export with --format=params or jax_export.')


def check_options(workdir: pathlib.Path, dtype: Any) -> None:
  """What can be refused before the model loads (`writer.export` calls it): the dtype, and a
  head family that does not implement `hf_export` at all."""
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  from mtp.model import mtp_model  # pylint: disable=import-outside-toplevel
  check_dtype(dtype)
  model_cfg = mtp_model.ModelConfig.from_config(checkpointing.load_config(workdir).model)
  if model_cfg.mtp_num_heads and model_cfg.family.hf_export is heads_lib.HeadFamily.hf_export:
    raise _no_format(model_cfg.mtp_head_type)


def head_export(model, embedding: np.ndarray, unembedding: np.ndarray,
                draft_ids: np.ndarray | None = None) -> heads_lib.HFExport | None:
  """The head family's `hf_export`, or None without heads; ExportError if it has no format."""
  if model.heads is None:
    return None
  cfg = model.cfg.trunk
  context = heads_lib.HFExportContext(
      trunk_cfg=cfg, embedding=embedding, unembedding=unembedding,
      block_tensors=lambda block, i: llama.block_tensors(nnx.to_pure_dict(nnx.state(block)), i),
      draft_ids=draft_ids)
  export = model.heads.hf_export(context)
  if export is None:
    raise _no_format(model.cfg.mtp_head_type)
  return export


def write(loaded, directory: pathlib.Path, dtype: Any = np.float32, *,
          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
  """Writes the Hugging Face export of `loaded` into the existing empty `directory`.

  Args:
    loaded: a `checkpoint.loading.LoadedModel` (trunk and heads merged).
    directory: where to write (empty; the caller stages and renames it).
    dtype: float32, bfloat16 or float16.
    max_shard_bytes: weights above this are sharded with an index.

  Returns:
    A JSON-able summary: dtype, files (relative path -> bytes), total bytes, and the heads'
    family, count and format.

  Raises:
    ExportError: a dtype the format cannot hold, a tensor out of its range, or a head family
      without a serving format; nothing is written then.
  """
  directory = pathlib.Path(directory)
  dtype = check_dtype(dtype)
  model, tokenizer = loaded.model, loaded.tokenizer
  cfg = model.cfg.trunk
  params = nnx.to_pure_dict(nnx.state(model.trunk))
  trunk = llama.from_params(params, cfg.tie_embeddings)
  unembedding = trunk.get(llama.LM_HEAD, trunk[llama.EMBED])
  draft_ids = None
  trained_vocab = loaded.config.get('mtp_head_draft_vocab') if model.heads is not None else 0
  if trained_vocab:  # The heads trained on a draft vocabulary: the same ids as decoding's.
    draft_ids = draft_vocab.draft_vocabulary(loaded, int(trained_vocab))
  heads = head_export(model, trunk[llama.EMBED], unembedding, draft_ids)
  extra = heads or heads_lib.HFExport(format='none')
  # Everything is converted (and checked) before the first file is written.
  weights = cast({**trunk, **extra.tensors}, dtype)
  subdirectories = {name: (sub.config, cast(sub.tensors, dtype))
                    for name, sub in extra.subdirectories.items()}

  special = tokenizer.special_ids
  write_json(directory / 'config.json',
             {**llama_config(cfg, special, dtype), **extra.config})
  write_weights(directory, weights, max_shard_bytes)
  (directory / 'tokenizer.json').write_text(tokenizer.to_json(), encoding='utf-8')
  write_json(directory / 'tokenizer_config.json', tokenizer_config(tokenizer, cfg.max_seq_len))
  if tokenizer.chat_template is not None:
    (directory / CHAT_TEMPLATE).write_text(tokenizer.chat_template, encoding='utf-8')
  generation = {'bos_token_id': special.bos_id, 'eos_token_id': special.eos_id,
                'pad_token_id': special.pad_id}
  suppressed = suppressed_ids(tokenizer, cfg.vocab_size)
  if suppressed:
    generation['suppress_tokens'] = suppressed
  write_json(directory / 'generation_config.json', generation)
  for name, (config, tensors) in subdirectories.items():
    sub = directory / name
    sub.mkdir()
    write_json(sub / 'config.json', {**config, 'torch_dtype': dtype.name})
    write_weights(sub, tensors, max_shard_bytes)
  return summary(directory, dtype, model, heads, extra)


def summary(directory: pathlib.Path, dtype: np.dtype, model, heads, extra) -> dict[str, Any]:
  files = {str(p.relative_to(directory)): p.stat().st_size
           for p in sorted(directory.rglob('*')) if p.is_file()}
  out = {'format': 'hf', 'dtype': dtype.name, 'files': files,
         'total_bytes': sum(files.values()), 'heads': None}
  if heads is not None:
    out['heads'] = {'family': model.cfg.mtp_head_type, 'num_heads': model.cfg.mtp_num_heads,
                    'format': extra.format, 'tensors_in_llama_directory': len(extra.tensors),
                    'subdirectories': sorted(extra.subdirectories)}
  return out
