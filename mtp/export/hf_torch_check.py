"""The Hugging Face export read by transformers: the oracles of `hf_test` (model, tokenizer,
greedy generation; the heads' formats are rebuilt in `mtp/model/heads/formats_torch_check.py`).

Every function takes paths and numpy arrays and returns numpy arrays, so that a test runs it in
a process of its own (`mtp.testing.oracle_process`): test workers never hold torch and its
threads beside JAX's.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np


def load_torch():
  """torch, on one thread."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)  # Its spinning workers would fight the tests' for the 2 cores.
  return torch


def _model(directory: pathlib.Path):
  import transformers  # pylint: disable=import-outside-toplevel
  torch = load_torch()
  return transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                           dtype=torch.float32).eval()


def weights(directory: pathlib.Path) -> dict:
  """Every tensor of a directory's safetensors (single or sharded) as torch tensors."""
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  out = {}
  for file in sorted(pathlib.Path(directory).glob('*.safetensors')):
    out.update(load_file(file))
  return out


def json_config(directory: pathlib.Path) -> dict:
  """A directory's config.json."""
  return json.loads((pathlib.Path(directory) / 'config.json').read_text())


def forward(directory: pathlib.Path, tokens: np.ndarray) -> dict[str, np.ndarray]:
  """transformers' model of the export on tokens [B, T]: {'logits' [B, T, V], 'hidden' [B, T, D]
  (the final norm's input, h_0), 'normed' (its output), 'layer_inputs' [L + 1, B, T, D]
  (hidden_states: the input of each layer, then the final norm's)}."""
  torch = load_torch()
  model = _model(directory)
  captured = {}
  hook = model.model.norm.register_forward_hook(
      lambda module, args, result: captured.update(hidden=args[0], normed=result))
  with torch.no_grad():
    out = model(torch.from_numpy(np.asarray(tokens)).long(), output_hidden_states=True)
  hook.remove()
  return {'logits': out.logits.numpy(), 'hidden': captured['hidden'].numpy(),
          'normed': captured['normed'].numpy(),
          'layer_inputs': torch.stack(out.hidden_states).numpy()}


def greedy(directory: pathlib.Path, prompts: list[list[int]],
           max_new_tokens: int) -> list[list[int]]:
  """transformers' greedy `generate`, with the exported generation_config, of each prompt's ids
  alone: the new ids."""
  torch = load_torch()
  model = _model(directory)
  out = []
  for prompt in prompts:
    ids = torch.tensor([prompt])
    with torch.no_grad():
      generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens)
    out.append(generated[0, ids.shape[1]:].tolist())
  return out


def tokenizer(directory: pathlib.Path, texts: dict[str, str], ids: dict[str, list[int]],
              messages: list[dict] | None) -> dict:
  """What `AutoTokenizer` makes of the export: {'encoded': name -> ids of texts[name] (its
  defaults: nothing added), 'decoded': name -> ids[name] decoded without special tokens,
  'special': (bos, eos, pad) ids, 'rendered': the chat template over `messages` with a
  generation prompt (None without messages)}."""
  import transformers  # pylint: disable=import-outside-toplevel
  theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
  return {
      'encoded': {name: theirs(text)['input_ids'] for name, text in texts.items()},
      'decoded': {name: theirs.decode(i, skip_special_tokens=True) for name, i in ids.items()},
      'special': (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id),
      'rendered': None if messages is None else theirs.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=True)}
