"""Small models and inputs for fast tests (importable by tests across the package)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from mtp.model import mtp_model
from mtp.model import transformer

# XLA's defaults, under which decoding runs, over the suite's fast flags (conftest): compile a
# program with these where a test reads what XLA made of it (without the fusion emitters, for
# one, XLA hoists nothing out of a loop).
DECODING_COMPILE = {'xla_backend_optimization_level': 3, 'xla_cpu_use_fusion_emitters': True}


def tiny_config(mtp_num_heads: int = 3, head_type: str = 'medusa', vocab_size: int = 61,
                num_layers: int = 2, tie_embeddings: bool = True) -> mtp_model.ModelConfig:
  """A 2-layer trunk of width 32 with `mtp_num_heads` heads of family `head_type`."""
  trunk = transformer.TransformerConfig(
      vocab_size=vocab_size, embed_dim=32, num_layers=num_layers, num_attention_heads=4,
      num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=128, tie_embeddings=tie_embeddings)
  return mtp_model.ModelConfig(trunk=trunk, mtp_num_heads=mtp_num_heads,
                               mtp_head_type=head_type)


def tiny_model(seed: int = 0, **kwargs) -> mtp_model.MTPModel:
  """A random tiny model. Zero-initialised head kernels (Medusa's ResBlocks) get random values,
  so that heads differ from the trunk and from each other."""
  model = mtp_model.MTPModel(tiny_config(**kwargs), rngs=nnx.Rngs(seed))
  if model.heads is not None:
    rng = np.random.default_rng(seed)
    for path, param in nnx.iter_graph(model.heads):
      if (isinstance(param, nnx.Param) and path and path[-1] == 'kernel'
          and not np.any(np.asarray(param[...]))):
        param[...] = rng.normal(0, 0.3, param[...].shape).astype(np.float32)
  return model


def random_tokens(shape, vocab_size: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, shape).astype(np.int32)
