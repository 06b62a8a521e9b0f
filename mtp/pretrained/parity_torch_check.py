"""transformers' side of the SmolLM2 parity checks (`parity_test`), run in a process of its own
(`mtp.testing.oracle_process`: test workers never hold torch and its threads beside JAX's).
Every function takes paths and numpy arrays and returns numpy arrays or lists; a model read
once stays loaded in the process.
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np


def _torch():
  import torch  # pylint: disable=import-outside-toplevel
  # One thread: on a busy 2-core machine torch's spinning OpenMP workers make generation 3-4x
  # slower (measured), and the tests' JAX threads share the same cores.
  torch.set_num_threads(1)
  return torch


def read_gguf(gguf_path: pathlib.Path, folder: pathlib.Path) -> None:
  """transformers' model and tokenizer from the GGUF file, saved in `folder` as they are (the
  model pickled whole: transformers saves no model it read from a GGUF file)."""
  import transformers  # pylint: disable=import-outside-toplevel
  torch = _torch()
  where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
  folder.mkdir(parents=True)
  torch.save(transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32),
             folder / 'model.pt')
  transformers.AutoTokenizer.from_pretrained(**where).save_pretrained(folder)


@functools.lru_cache(maxsize=2)
def _model(folder: pathlib.Path):
  """`read_gguf`'s pickled model in `folder`, or a Hugging Face directory's."""
  import transformers  # pylint: disable=import-outside-toplevel
  torch = _torch()
  if (folder / 'model.pt').exists():
    return torch.load(folder / 'model.pt', weights_only=False).eval()
  return transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                           dtype=torch.float32).eval()


def state(folder: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """The model's parameters `names` (Hugging Face names)."""
  values = _model(folder).state_dict()
  return {name: values[name].numpy() for name in names}


def tokenizer(folder: pathlib.Path, texts: dict[str, str], ids: dict[str, list[int]], *,
              add_special_tokens: bool = True, digit_split: bool = False,
              messages: list[dict] | None = None) -> dict:
  """What `AutoTokenizer` makes of `folder`: {'encoded': name -> ids of texts[name], 'decoded':
  name -> ids[name] decoded without special tokens, 'special': (bos, eos, pad) ids,
  'chat_template', 'rendered': the template over `messages` with a generation prompt}.
  digit_split: with SmolLM2's digit split restored (transformers' GGUF loader drops it)."""
  import transformers  # pylint: disable=import-outside-toplevel
  theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
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


def logits(folder: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
  """The model's logits [B, T, V] over tokens [B, T]."""
  torch = _torch()
  with torch.no_grad():
    return _model(folder)(torch.from_numpy(np.asarray(tokens)).long()).logits.numpy()


def greedy(folder: pathlib.Path, prompts: list[list[int]], max_new_tokens: int,
           eos: int) -> list[list[int]]:
  """transformers' greedy `generate` of each prompt's ids alone, `eos` ending it: the new ids."""
  torch = _torch()
  model, out = _model(folder), []
  for prompt in prompts:
    ids = torch.tensor([prompt])
    with torch.no_grad():
      generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=eos)
    out.append(generated[0, ids.shape[1]:].tolist())
  return out
