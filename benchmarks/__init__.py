"""Benchmarks: side-by-side ratios measured in one run, written as JSON (and plots) under
results/."""

import json
import pathlib


def write_json(path: str | pathlib.Path, data) -> pathlib.Path:
  """Writes `data` as indented JSON to `path` (its directory created), says so, returns it."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=2))
  print(f'\nwrote {path}')
  return path


SMOLLM2_SHAPE = dict(vocab_size=49_152, embed_dim=576, num_layers=30, num_attention_heads=9,
                     num_kv_heads=3, head_dim=64, mlp_dim=1536, max_seq_len=2048,
                     rope_theta=100_000.0, tie_embeddings=True)
NUM_HEADS = 4  # Medusa heads of the random SmolLM2-shaped model.


def random_model(tiny: bool, dtype: str = 'bfloat16'):
  """SmolLM2's shape (or a tiny one) with random weights and random Medusa heads, in `dtype`."""
  from flax import nnx
  import numpy as np
  from mtp.model import mtp_model
  from mtp.model import transformer
  if tiny:
    shape = dict(vocab_size=256, embed_dim=32, num_layers=2, num_attention_heads=4,
                 num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=512)
  else:
    shape = SMOLLM2_SHAPE
  trunk = transformer.TransformerConfig(**shape, dtype=dtype, param_dtype=dtype)
  cfg = mtp_model.ModelConfig(trunk=trunk, mtp_num_heads=NUM_HEADS, mtp_head_type='medusa')
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  # Medusa's ResBlocks start at zero (each head then copies the trunk); random ones draft
  # tokens of their own, as trained heads would, so drafting does its full work.
  rng = np.random.default_rng(0)
  for path, param in nnx.iter_graph(model.heads):
    if isinstance(param, nnx.Param) and path and path[-1] == 'kernel':
      value = param[...]
      if not np.any(np.asarray(value, np.float32)):
        param[...] = rng.normal(0, 0.02, value.shape).astype(value.dtype)
  return model
