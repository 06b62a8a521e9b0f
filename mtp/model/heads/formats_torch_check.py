"""The heads' export formats rebuilt in torch from their published descriptions, not from
mtp's modules: vLLM's Medusa ResBlocks, DeepSeek-V3's MTP layer, the parallel-heads layout of
`parallel.py` and the speculative-streaming layout its config describes. The oracles of
`mtp/export/hf_test.py`, over the Llama directory `launch.export --format=hf` writes; every
function takes paths and numpy arrays and returns numpy arrays, so that a test runs it in a
process of its own (`mtp.testing.oracle_process`).
"""

from __future__ import annotations

import pathlib

import numpy as np

from mtp.export import hf_torch_check
from mtp.export.hf_torch_check import json_config, load_torch, weights


def _rms(x, weight, eps):
  return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def _rotary(torch, v, positions, theta):
  """Hugging Face Llama's rotary embedding (rotate_half) of v [..., N, hd] at positions [...]."""
  hd = v.shape[-1]
  inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
  angles = positions.to(torch.float64)[..., None] * inv_freq
  angles = torch.cat([angles, angles], -1)
  cos, sin = angles.cos().float()[..., None, :], angles.sin().float()[..., None, :]
  half = hd // 2
  return v * cos + torch.cat([-v[..., half:], v[..., :half]], -1) * sin


def _llama_layer(torch, x, w: dict, prefix: str, config: dict):
  """One Hugging Face Llama decoder layer over x [T, D], causal, positions 0..T-1 (rotate_half
  rotary embedding, grouped-query attention, SwiGLU), from the published architecture."""
  f = torch.nn.functional
  t = x.shape[0]
  heads, groups, hd = (config['num_attention_heads'], config['num_key_value_heads'],
                       config['head_dim'])
  positions, theta = torch.arange(t), config['rope_theta']
  h = _rms(x, w[prefix + 'input_layernorm.weight'], config['rms_norm_eps'])
  q = _rotary(torch, (h @ w[prefix + 'self_attn.q_proj.weight'].T).view(t, heads, hd),
              positions, theta)
  k = _rotary(torch, (h @ w[prefix + 'self_attn.k_proj.weight'].T).view(t, groups, hd),
              positions, theta)
  v = (h @ w[prefix + 'self_attn.v_proj.weight'].T).view(t, groups, hd)
  k, v = (z.repeat_interleave(heads // groups, dim=1) for z in (k, v))
  attended = f.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                            v.transpose(0, 1), is_causal=True)
  x = x + attended.transpose(0, 1).reshape(t, -1) @ w[prefix + 'self_attn.o_proj.weight'].T
  h = _rms(x, w[prefix + 'post_attention_layernorm.weight'], config['rms_norm_eps'])
  mlp = f.silu(h @ w[prefix + 'mlp.gate_proj.weight'].T) * (h @ w[prefix + 'mlp.up_proj.weight'].T)
  return x + mlp @ w[prefix + 'mlp.down_proj.weight'].T


def medusa_logits(directory: pathlib.Path, normed: np.ndarray) -> np.ndarray:
  """vLLM's Medusa over `medusa/`: per head, ResBlocks x + SiLU(W x + b), then that head's
  lm_head, on the target's last hidden state after its final norm, normed [T, D] ->
  [heads, T, V]."""
  torch = load_torch()
  config, w = json_config(directory / 'medusa'), weights(directory / 'medusa')
  out = []
  with torch.no_grad():
    for i in range(config['num_heads']):
      x = torch.from_numpy(normed)
      for j in range(config['num_hidden_layers']):
        x = x + torch.nn.functional.silu(x @ w[f'blocks.{i}.layers.{j}.weight'].T
                                         + w[f'blocks.{i}.layers.{j}.bias'])
      out.append(x @ w[f'lm_heads.{i}.weight'].T)
  return torch.stack(out).numpy()


def deepseek_mtp_logits(directory: pathlib.Path, tokens: np.ndarray,
                        hidden: np.ndarray) -> np.ndarray:
  """DeepSeek-V3's MTP layer k (vLLM's deepseek_mtp.py) over the Llama directory's extra layers:
  h_k = block(eh_proj(cat[enorm(emb), hnorm(h_{k-1})])) over the tokens shifted by k, logits =
  shared_head.head(shared_head.norm(h_k)); tokens [T], hidden: h_0 [T, D] before the final norm
  (as mtp trains it; see sequential.py on vLLM's choice) -> [depth, T, V]."""
  torch = load_torch()
  config, w = json_config(directory), weights(directory)
  layers, eps = config['num_hidden_layers'], config['rms_norm_eps']
  tokens, h = torch.from_numpy(np.asarray(tokens)).long(), torch.from_numpy(hidden)
  embed = w[f'model.layers.{layers}.embed_tokens.weight']
  out = []
  with torch.no_grad():
    for k in range(config['num_nextn_predict_layers']):
      p = f'model.layers.{layers + k}.'
      # At position i the module reads token i + k + 1 (zeros past the end, as in training).
      shifted = torch.cat([embed[tokens[k + 1:]], torch.zeros(k + 1, embed.shape[1])])
      x = torch.cat([_rms(shifted, w[p + 'enorm.weight'], eps),
                     _rms(h, w[p + 'hnorm.weight'], eps)], -1) @ w[p + 'eh_proj.weight'].T
      h = _llama_layer(torch, x, w, p, config)
      normed = _rms(h, w[p + 'shared_head.norm.weight'], eps)
      out.append(normed @ w[p + 'shared_head.head.weight'].T)
  return torch.stack(out).numpy()


def parallel_heads_logits(directory: pathlib.Path, hidden: np.ndarray) -> np.ndarray:
  """parallel_heads/: logits_k = lm_head(norm_k(layer_k(h_0))), hidden: h_0 [T, D] before the
  final norm -> [heads, T, V]."""
  torch = load_torch()
  config, w = json_config(directory / 'parallel_heads'), weights(directory / 'parallel_heads')
  base = weights(directory)
  lm_head = base.get('lm_head.weight', base['model.embed_tokens.weight'])
  h = torch.from_numpy(hidden)
  with torch.no_grad():
    return torch.stack([
        _rms(_llama_layer(torch, h, w, f'model.layers.{k}.', config),
             w[f'model.layers.{k}.norm.weight'], config['rms_norm_eps']) @ lm_head.T
        for k in range(config['num_heads'])]).numpy()


def streaming_logits(directory: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
  """speculative_streaming/: the streams as its config's description states them, on
  transformers' own layer inputs and the Llama directory's weights; tokens [1, T] ->
  [T, streams, V]."""
  torch = load_torch()
  config, w = json_config(directory / 'speculative_streaming'), weights(
      directory / 'speculative_streaming')
  base_config, base = json_config(directory), weights(directory)
  num_layers, gamma = base_config['num_hidden_layers'], config['num_streams']
  heads, groups, hd = (base_config['num_attention_heads'], base_config['num_key_value_heads'],
                       base_config['head_dim'])
  eps, theta = base_config['rms_norm_eps'], base_config['rope_theta']
  first = num_layers - config['streaming_layers']
  layer_inputs = hf_torch_check.forward(directory, tokens)['layer_inputs']
  inputs = torch.from_numpy(layer_inputs[:, 0])  # [L + 1, T, D]
  t = tokens.shape[1]
  main_positions = torch.arange(t)
  stream_positions = main_positions[:, None] + torch.arange(1, gamma + 1)[None]  # [T, γ]
  start = inputs[first]
  scale = start.pow(2).mean(-1, keepdim=True).sqrt()  # The token's RMS: the embeddings' unit.
  streams = start[:, None] + scale[:, None] * w['stream_embeddings']  # [T, γ, D]
  with torch.no_grad():
    for i in range(first, num_layers):
      p = f'model.layers.{i}.'
      main = _rms(inputs[i], base[p + 'input_layernorm.weight'], eps)
      k_main = _rotary(torch, (main @ base[p + 'self_attn.k_proj.weight'].T).view(t, groups, hd),
                       main_positions, theta)
      v_main = (main @ base[p + 'self_attn.v_proj.weight'].T).view(t, groups, hd)
      x = _rms(streams, base[p + 'input_layernorm.weight'], eps)

      def projected(name, x=x, p=p):
        out = x @ base[p + f'self_attn.{name}.weight'].T
        if config['adapter_rank']:  # Stream j's low-rank update, x A_j^T B_j^T.
          a = w[p + f'self_attn.{name}.lora_A.weight']
          b = w[p + f'self_attn.{name}.lora_B.weight']
          out = out + torch.einsum('tjd,jrd,jor->tjo', x, a, b)
        return out
      q = _rotary(torch, projected('q_proj').view(t, gamma, heads, hd), stream_positions, theta)
      k = _rotary(torch, (x @ base[p + 'self_attn.k_proj.weight'].T).view(t, gamma, groups, hd),
                  stream_positions, theta)
      v = projected('v_proj').view(t, gamma, groups, hd)
      rep = heads // groups
      k_main, v_main, k, v = (z.repeat_interleave(rep, dim=-2) for z in (k_main, v_main, k, v))
      scores_main = torch.einsum('tjnh,snh->tjns', q, k_main) / hd ** 0.5
      scores_main = scores_main.masked_fill(
          (main_positions[None, :] > main_positions[:, None])[:, None, None], float('-inf'))
      scores_own = torch.einsum('tjnh,tinh->tjni', q, k) / hd ** 0.5
      scores_own = scores_own.masked_fill(
          torch.ones(gamma, gamma, dtype=torch.bool).triu(1)[None, :, None], float('-inf'))
      probs = torch.softmax(torch.cat([scores_main, scores_own], -1), -1)
      attended = (torch.einsum('tjns,snh->tjnh', probs[..., :t], v_main)
                  + torch.einsum('tjni,tinh->tjnh', probs[..., t:], v))
      streams = streams + attended.reshape(t, gamma, -1) @ base[p + 'self_attn.o_proj.weight'].T
      h = _rms(streams, base[p + 'post_attention_layernorm.weight'], eps)
      mlp = (torch.nn.functional.silu(h @ base[p + 'mlp.gate_proj.weight'].T)
             * (h @ base[p + 'mlp.up_proj.weight'].T))
      streams = streams + mlp @ base[p + 'mlp.down_proj.weight'].T
    lm_head = base.get('lm_head.weight', base['model.embed_tokens.weight'])
    return (_rms(streams, base['model.norm.weight'], eps) @ lm_head.T).numpy()  # [T, γ, V]
