r"""vLLM's EAGLE-3 drafter forward, rebuilt in torch from an `hf` export: the export check's oracle.

  python -m mtp.model.heads.eagle3_torch_check EXPORT_DIR TOKENS.npy OUT.npz

Reads the Llama directory `launch.export --format=hf` writes and its eagle3/ drafter
(`midlayer.*`, `fc.weight` [h, 3h], the norms, `lm_head`), runs transformers' Llama of the export
for the auxiliary hidden states (its hidden_states[i] enters layer i, vLLM's id i), then
Eagle3LlamaForCausalLM's forward written with transformers' Llama parts: `fc` over the
concatenated states, its one layer over [norm(embedding of token t + 1), norm(fused)], and the
final norm. Writes the drafter's normalised states `normed` [1, T - 1, D] and `logits`.

`eagle3_test` runs `drafter_outputs` in a process of its own (`mtp.testing.oracle_process`), as
every torch oracle runs.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np


def drafter_outputs(export_dir: pathlib.Path, tokens: np.ndarray) -> dict[str, np.ndarray]:
  """{'normed': [1, T - 1, D], 'logits': [1, T - 1, V']} of the export's EAGLE-3 drafter at
  depth 1 over tokens [1, T]."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  from transformers.models.llama import modeling_llama  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)  # Its spinning workers would fight the test's for the 2 cores.
  sub = export_dir / 'eagle3'
  w = load_file(sub / 'model.safetensors')
  config = transformers.AutoConfig.from_pretrained(str(sub))
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  aux_ids = config.eagle_aux_hidden_state_layer_ids
  target = transformers.AutoModelForCausalLM.from_pretrained(
      str(export_dir), dtype=torch.float32).eval()
  ids = torch.from_numpy(tokens).long()
  d = config.hidden_size
  t = ids.shape[1] - 1

  def linear(name, in_features):
    layer = torch.nn.Linear(in_features, w[name].shape[0], bias=False)
    layer.weight.data = w[name]
    return layer

  def norm(name):
    layer = modeling_llama.LlamaRMSNorm(d, eps=config.rms_norm_eps)
    layer.weight.data = w[name]
    return layer

  attn = modeling_llama.LlamaAttention(config, layer_idx=0)
  for proj in ('q_proj', 'k_proj', 'v_proj'):
    setattr(attn, proj, linear(f'midlayer.self_attn.{proj}.weight', 2 * d))
  attn.o_proj = linear('midlayer.self_attn.o_proj.weight',
                       w['midlayer.self_attn.o_proj.weight'].shape[1])
  mlp = modeling_llama.LlamaMLP(config)
  mlp.load_state_dict({f'{p}.weight': w[f'midlayer.mlp.{p}.weight']
                       for p in ('gate_proj', 'up_proj', 'down_proj')})
  rotary = modeling_llama.LlamaRotaryEmbedding(config)
  with torch.no_grad():
    hidden_states = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hidden_states[i] for i in aux_ids], dim=-1)[:, :-1]
    hidden = aux @ w['fc.weight'].T  # combine_hidden_states
    embeds = w['embed_tokens.weight'][ids[:, 1:]]  # Position t reads token t + 1.
    x = torch.cat([norm('midlayer.input_layernorm.weight')(embeds),
                   norm('midlayer.hidden_norm.weight')(hidden)], dim=-1)
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float('-inf')).triu(1)[None, None]
    attended, _ = attn(x, position_embeddings=rotary(x, positions), attention_mask=mask)
    residual = hidden + attended
    out = residual + mlp(norm('midlayer.post_attention_layernorm.weight')(residual))
    normed = norm('norm.weight')(out)
    logits = normed @ w['lm_head.weight'].T
  return {'normed': normed.numpy(), 'logits': logits.numpy(),
          'aux_ids': np.asarray(aux_ids, np.int32)}


def main(argv: list[str]) -> int:
  if len(argv) != 4:
    print(f'usage: python -m {__spec__.name} EXPORT_DIR TOKENS.npy OUT.npz', file=sys.stderr)
    return 2
  export_dir, tokens, out = pathlib.Path(argv[1]), np.load(argv[2]), pathlib.Path(argv[3])
  np.savez(out, **drafter_outputs(export_dir, tokens))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
