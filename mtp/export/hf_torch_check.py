"""The Hugging Face export read by transformers: the oracles of `hf_test` (model, tokenizer,
greedy generation; the heads' formats are rebuilt in `mtp/model/heads/formats_torch_check.py`).

Every function takes paths and numpy arrays and returns numpy arrays, so that a test runs it in
a process of its own (`mtp.testing.oracle_process`): test workers never hold torch and its
threads beside JAX's.
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np


def load_torch():
  """torch, on one thread."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)  # Its spinning workers would fight the tests' for the 2 cores.
  return torch


@functools.lru_cache(maxsize=2)
def model(directory: pathlib.Path):
  """transformers' model of a Hugging Face directory in float32, or the model pickled whole in
  its model.pt (`parity_torch_check.read_gguf`); read once a process."""
  import transformers  # pylint: disable=import-outside-toplevel
  torch = load_torch()
  if (directory / 'model.pt').exists():
    return torch.load(directory / 'model.pt', weights_only=False).eval()
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
  reference = model(directory)
  captured = {}
  hook = reference.model.norm.register_forward_hook(
      lambda module, args, result: captured.update(hidden=args[0], normed=result))
  with torch.no_grad():
    out = reference(torch.from_numpy(np.asarray(tokens)).long(), output_hidden_states=True)
  hook.remove()
  return {'logits': out.logits.numpy(), 'hidden': captured['hidden'].numpy(),
          'normed': captured['normed'].numpy(),
          'layer_inputs': torch.stack(out.hidden_states).numpy()}


def greedy(directory: pathlib.Path, prompts: list[list[int]], max_new_tokens: int,
           eos: int | None = None) -> list[list[int]]:
  """transformers' greedy `generate` of each prompt's ids alone, with the directory's
  generation_config (or `eos` ending it, and padding): the new ids."""
  torch = load_torch()
  reference, out = model(directory), []
  stop = {} if eos is None else dict(eos_token_id=eos, pad_token_id=eos)
  for prompt in prompts:
    ids = torch.tensor([prompt])
    with torch.no_grad():
      generated = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, **stop)
    out.append(generated[0, ids.shape[1]:].tolist())
  return out


def tokenizer(directory: pathlib.Path, texts: dict[str, str], ids: dict[str, list[int]],
              messages: list[dict] | None = None, *, add_special_tokens: bool = True,
              digit_split: bool = False) -> dict:
  """What `AutoTokenizer` makes of `directory`: {'encoded': name -> ids of texts[name] (with
  `add_special_tokens` as given), 'decoded': name -> ids[name] decoded without special tokens,
  'special': (bos, eos, pad) ids, 'chat_template', 'rendered': the template over `messages`
  with a generation prompt (None without messages)}. digit_split: with SmolLM2's digit split
  restored (transformers' GGUF loader drops it)."""
  import transformers  # pylint: disable=import-outside-toplevel
  theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
  if digit_split:
    from tokenizers import pre_tokenizers  # pylint: disable=import-outside-toplevel
    theirs.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  return {
      'encoded': {name: theirs(text, add_special_tokens=add_special_tokens)['input_ids']
                  for name, text in texts.items()},
      'decoded': {name: theirs.decode(i, skip_special_tokens=True) for name, i in ids.items()},
      'special': (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id),
      'chat_template': theirs.chat_template,
      'rendered': None if messages is None else theirs.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=True)}
