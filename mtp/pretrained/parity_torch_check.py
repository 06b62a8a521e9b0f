"""transformers' side of the SmolLM2 parity checks (`parity_test`), run in a process of its own
(`mtp.testing.oracle_process`: test workers never hold torch and its threads beside JAX's).
Every function takes paths and numpy arrays and returns numpy arrays or lists; a model read
once stays loaded in the process (`hf_torch_check.model`). Tokenizers and greedy generation are
`hf_torch_check`'s.
"""

from __future__ import annotations

import pathlib

import numpy as np

from mtp.export import hf_torch_check


def read_gguf(gguf_path: pathlib.Path, folder: pathlib.Path) -> None:
  """transformers' model and tokenizer from the GGUF file, saved in `folder` as they are (the
  model pickled whole: transformers saves no model it read from a GGUF file)."""
  import transformers  # pylint: disable=import-outside-toplevel
  torch = hf_torch_check.load_torch()
  where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
  folder.mkdir(parents=True)
  torch.save(transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32),
             folder / 'model.pt')
  transformers.AutoTokenizer.from_pretrained(**where).save_pretrained(folder)


def state(folder: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """The model's parameters `names` (Hugging Face names)."""
  values = hf_torch_check.model(folder).state_dict()
  return {name: values[name].numpy() for name in names}


def logits(folder: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
  """The model's logits [B, T, V] over tokens [B, T]."""
  torch = hf_torch_check.load_torch()
  reference = hf_torch_check.model(folder)
  with torch.no_grad():
    return reference(torch.from_numpy(np.asarray(tokens)).long()).logits.numpy()
