"""vLLM's EAGLE drafter forward, written with transformers' Llama layer: the oracle of
`eagle_test`, run in a process of its own (`mtp.testing.oracle_process`: test workers never hold
torch and its threads beside JAX's).
"""

from __future__ import annotations

import numpy as np


def depth_one(config: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray,
              normed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """vLLM's EagleLlamaForCausalLM over the eagle/ export (`config`, `tensors`): fc over
  [embedding of token t + 1; the target's hidden state after its final norm], one layer without
  input norm, no final norm, the target's lm_head (tied to the embedding). tokens [1, T],
  normed [1, T, D] -> (hidden states [1, T - 1, D], logits [1, T - 1, V])."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)  # Its spinning workers would fight the tests' for the 2 cores.
  llama = transformers.LlamaModel(transformers.LlamaConfig(**{
      k: v for k, v in config.items() if k not in ('architectures', 'model_type')})).eval()
  llama.layers[0].input_layernorm = torch.nn.Identity()
  llama.norm = torch.nn.Identity()
  state = {name: torch.from_numpy(value) for name, value in tensors.items()
           if name != 'fc.weight'}
  missing, unexpected = llama.load_state_dict(state, strict=False)
  if missing or unexpected:
    raise ValueError(f'eagle/ does not load into a Llama layer: missing {missing}, '
                     f'unexpected {unexpected}')
  fc = torch.from_numpy(tensors['fc.weight'])
  ids = torch.from_numpy(tokens).long()
  t = ids.shape[1] - 1
  with torch.no_grad():
    embeds = llama.embed_tokens(ids[:, 1:])  # Position t reads token t + 1.
    x = torch.cat([embeds, torch.from_numpy(normed)[:, :-1]], dim=-1) @ fc.T
    out = llama(inputs_embeds=x, position_ids=torch.arange(t)[None]).last_hidden_state
    logits = out @ llama.embed_tokens.weight.T
  return out.numpy(), logits.numpy()
