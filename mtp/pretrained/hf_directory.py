"""Reads a Hugging Face model directory of a Llama-architecture model into a `llama.Checkpoint`.

The directory holds `config.json` (`LlamaForCausalLM`, or a Mistral without sliding-window
attention, which is the same network), `model.safetensors` or shards listed in
`model.safetensors.index.json`, and `tokenizer.json`. Special ids come from
`generation_config.json`, then `config.json`, then `tokenizer_config.json` (the order in which
`transformers` generation looks them up); padding falls back to eos. A chat template comes from
`chat_template.jinja`, else from `tokenizer_config.json` (`chat_template`, a string or a list of
named templates, of which 'default' is taken).

Multi-token heads in the formats `mtp.export.hf` writes (DeepSeek-V3-style MTP layers
`model.layers.{L+k}.*` after the trunk's L with `num_nextn_predict_layers` in config.json, or a
subdirectory such as `medusa/`) are found by asking every registered head family
(`HeadFamily.hf_import`); they are not part of the trunk's tensors.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import tokenizers

from mtp.data import tokenizer as tokenizer_lib
from mtp.pretrained import llama
from mtp.pretrained import safetensors_file
from mtp.pretrained.llama import PretrainedError

CONFIG, INDEX, SINGLE = 'config.json', 'model.safetensors.index.json', 'model.safetensors'
TOKENIZER = 'tokenizer.json'
TOKENIZER_CONFIG, CHAT_TEMPLATE = 'tokenizer_config.json', 'chat_template.jinja'
ARCHITECTURES = ('LlamaForCausalLM', 'MistralForCausalLM')


def _read_json(path: pathlib.Path, required: bool = True) -> dict[str, Any]:
  if not path.is_file():
    if required:
      raise PretrainedError(f'{path} does not exist.')
    return {}
  try:
    value = json.loads(path.read_text(encoding='utf-8'))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise PretrainedError(f'{path} is not valid JSON ({e}).') from e
  if not isinstance(value, dict):
    raise PretrainedError(f'{path} does not hold a JSON object.')
  return value


def read_shape(config: dict[str, Any], path: pathlib.Path) -> llama.LlamaShape:
  """The trunk's hyper-parameters from a `config.json`, refusing what the trunk cannot run."""
  architectures = config.get('architectures') or []
  model_type = config.get('model_type')
  if not (set(architectures) & set(ARCHITECTURES)) and model_type not in ('llama', 'mistral'):
    raise PretrainedError(f'{path}: architecture {architectures or model_type!r} is not '
                          f'supported; only {", ".join(ARCHITECTURES)} can be imported.')
  window = config.get('sliding_window')
  if window is not None and window < config.get('max_position_embeddings', 0):
    raise PretrainedError(f'{path}: sliding-window attention (sliding_window={window}) is not '
                          'supported.')
  scaling = config.get('rope_scaling') or {}
  rope = dict(config.get('rope_parameters') or {})  # transformers >= 5 keeps theta here.
  kind = scaling.get('rope_type', scaling.get('type')) or rope.get('rope_type', 'default')
  if kind not in ('default', None):
    raise PretrainedError(f'{path}: rope scaling {kind!r} is not supported (the trunk uses plain '
                          'rotary embeddings).')
  for key, allowed in (('hidden_act', 'silu'), ('attention_bias', False), ('mlp_bias', False)):
    if config.get(key, allowed) != allowed:
      raise PretrainedError(f'{path}: {key}={config[key]!r} is not supported (expected '
                            f'{allowed!r}).')
  if config.get('partial_rotary_factor', 1.0) != 1.0:
    raise PretrainedError(f'{path}: partial rotary embeddings are not supported.')
  try:
    num_heads = int(config['num_attention_heads'])
    embed_dim = int(config['hidden_size'])
    return llama.LlamaShape(
        vocab_size=int(config['vocab_size']), embed_dim=embed_dim,
        num_layers=int(config['num_hidden_layers']), num_attention_heads=num_heads,
        num_kv_heads=int(config.get('num_key_value_heads') or num_heads),
        head_dim=int(config.get('head_dim') or embed_dim // max(num_heads, 1)),
        mlp_dim=int(config['intermediate_size']),
        max_seq_len=int(config.get('max_position_embeddings', 2048)),
        rope_theta=float(config.get('rope_theta') or rope.get('rope_theta') or 10_000.0),
        norm_eps=float(config.get('rms_norm_eps', 1e-6)),
        tie_embeddings=bool(config.get('tie_word_embeddings', False)))
  except KeyError as e:
    raise PretrainedError(f'{path}: {e.args[0]} is missing.') from e


def weight_files(directory: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
  """Safetensors file -> the tensor names to read from it (None: all)."""
  index = directory / INDEX
  if index.is_file():
    weight_map = _read_json(index).get('weight_map')
    if not isinstance(weight_map, dict) or not weight_map:
      raise PretrainedError(f'{index} has no weight_map.')
    files: dict[pathlib.Path, list[str]] = {}
    for name, file in weight_map.items():
      files.setdefault(directory / file, []).append(name)
    for file in files:
      if not file.is_file():
        raise PretrainedError(f'{file} (listed in {index}) does not exist.')
    return files
  if (directory / SINGLE).is_file():
    return {directory / SINGLE: None}
  raise PretrainedError(f'{directory} holds neither {SINGLE} nor {INDEX} (only safetensors '
                        'weights can be imported).')


def _token_id(tok: tokenizers.Tokenizer, value) -> int | None:
  """An id from a config value: an int, a list of ints (the first), or a token string/dict."""
  if isinstance(value, list):
    value = value[0] if value else None
  if isinstance(value, dict):
    value = value.get('content')
  if isinstance(value, str):
    return tok.token_to_id(value)
  return value if isinstance(value, int) else None


def special_ids(directory: pathlib.Path, config: dict[str, Any],
                tok: tokenizers.Tokenizer) -> tokenizer_lib.SpecialIds:
  sources = [(_read_json(directory / 'generation_config.json', required=False), '_token_id'),
             (config, '_token_id'),
             (_read_json(directory / TOKENIZER_CONFIG, required=False), '_token')]

  def find(kind: str) -> int | None:
    for values, suffix in sources:
      found = _token_id(tok, values.get(kind + suffix))
      if found is not None:
        return found
    return None

  eos = find('eos')
  if eos is None:
    raise PretrainedError(f'{directory}: no eos token id in generation_config.json, '
                          'config.json or tokenizer_config.json.')
  pad, bos = find('pad'), find('bos')
  return tokenizer_lib.SpecialIds(pad_id=eos if pad is None else pad, eos_id=eos,
                                  bos_id=eos if bos is None else bos)


def chat_template(directory: pathlib.Path) -> str | None:
  """The directory's chat template (Jinja source), or None."""
  path = directory / CHAT_TEMPLATE
  if path.is_file():
    try:
      return path.read_text(encoding='utf-8')
    except UnicodeDecodeError as e:
      raise PretrainedError(f'{path} is not UTF-8 text ({e}).') from e
  config_path = directory / TOKENIZER_CONFIG
  template = _read_json(config_path, required=False).get('chat_template')
  if isinstance(template, list):  # Named templates: [{'name': ..., 'template': ...}, ...].
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    template = named.get('default', next(iter(named.values()), None))
  if template is not None and not isinstance(template, str):
    raise PretrainedError(f'{config_path}: chat_template is neither a string nor a list of '
                          'named templates.')
  return template


def read_tokenizer(directory: pathlib.Path, config: dict[str, Any]) -> tokenizer_lib.Tokenizer:
  path = directory / TOKENIZER
  if not path.is_file():
    raise PretrainedError(f'{path} does not exist (the tokenizer is needed).')
  try:
    tok = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises a bare Exception on bad files.
    raise PretrainedError(f'{path} is not a readable tokenizer ({e}).') from e
  try:
    return tokenizer_lib.Tokenizer(tok, special_ids(directory, config, tok),
                                   chat_template(directory))
  except ValueError as e:
    raise PretrainedError(f'{path}: {e}') from e


def read(directory: str | pathlib.Path) -> llama.Checkpoint:
  """Reads and checks a Hugging Face directory: hyper-parameters, float32 tensors, tokenizer.

  Raises:
    PretrainedError: naming the file and what is wrong.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise PretrainedError(f'{directory} is not a directory.')
  config = _read_json(directory / CONFIG)
  shape = read_shape(config, directory / CONFIG)
  tokenizer = read_tokenizer(directory, config)
  files = weight_files(directory)
  tensors = read_tensors(files)
  if shape.tie_embeddings:
    tensors.pop(llama.LM_HEAD, None)  # Some tied checkpoints store a copy; the trunk ties.
  extra = {}  # MTP layers after the trunk's: heads, not trunk.
  if config.get('num_nextn_predict_layers'):
    extra = {name: tensors.pop(name) for name in list(tensors)
             if (llama.layer_index(name) or 0) >= shape.num_layers}
  checkpoint = llama.Checkpoint(
      shape=shape, tensors=tensors, tokenizer=tokenizer,
      source={'format': 'hf', 'path': str(directory.absolute()),
              'name': config.get('_name_or_path', directory.name),
              'files': [str(directory / CONFIG), str(directory / TOKENIZER)]
                       + sorted(str(f) for f in files)})
  llama.check(checkpoint, str(directory))
  checkpoint.heads = read_heads(directory, config, checkpoint, extra)
  return checkpoint


def read_tensors(files: dict[pathlib.Path, list[str] | None]) -> dict[str, Any]:
  """`weight_files`' tensors as float32 arrays."""
  tensors = {}
  for file, names in files.items():
    tensors.update(safetensors_file.read(file, set(names) if names is not None else None))
  return tensors


def read_heads(directory: pathlib.Path, config: dict[str, Any], checkpoint: llama.Checkpoint,
               extra: dict[str, Any]):
  """(family name, `heads.HFImport`) of the multi-token heads the directory holds, or None.

  Every registered family is asked; a directory with heads of two families is refused.
  """
  from mtp.model import heads as heads_lib  # pylint: disable=import-outside-toplevel
  from mtp.model import transformer  # pylint: disable=import-outside-toplevel

  def subdirectory(name: str):
    sub = directory / name
    if not sub.is_dir():
      return None
    return heads_lib.HFSubdirectory(_read_json(sub / CONFIG), read_tensors(weight_files(sub)))

  def block_params(tensors, i: int):
    missing = [name for name in llama.layer_names(i).values() if name not in tensors]
    if missing:
      raise ValueError(f'missing tensor {missing[0]}.')
    return llama.block_params(tensors, i)

  embedding = checkpoint.tensors[llama.EMBED]
  source = heads_lib.HFImportSource(
      config=config,
      trunk_cfg=transformer.TransformerConfig.from_config(checkpoint.shape.model_config()),
      embedding=embedding, unembedding=checkpoint.tensors.get(llama.LM_HEAD, embedding),
      tensors=extra, subdirectory=subdirectory, block_params=block_params)
  found = []
  for name, family in heads_lib.FAMILIES.items():
    try:
      heads = family.hf_import(source)
    except PretrainedError:
      raise
    except ValueError as e:
      raise PretrainedError(f'{directory}: its {name} heads cannot be imported: {e}') from e
    if heads is not None:
      found.append((name, heads))
  if len(found) > 1:
    raise PretrainedError(f'{directory} holds heads of {" and ".join(n for n, _ in found)}; an '
                          'mtp model has heads of one family.')
  return found[0] if found else None
