"""A block verified in attention order returns what a pass in node order returns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.decode import trees
from mtp.decode import verification
from mtp.model import heads
from mtp.model import kv_cache
from mtp.model import mtp_model
from mtp.model import testing


def _model(head_type, dtype):
  model = testing.tiny_model(head_type=head_type)
  if dtype == 'float32':
    return model
  cfg = model.cfg
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype=dtype,
                                                           param_dtype=dtype))
  half = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  nnx.update(half, jax.tree.map(lambda a: a.astype(dtype), nnx.state(model, nnx.Param)))
  return half


# Every family in bfloat16, where the pass must be exact; float32 once.
@pytest.mark.parametrize('head_type, dtype', [(family, 'bfloat16') for family in
                                              sorted(heads.FAMILIES)] + [('eagle', 'float32')])
def test_a_block_in_attention_order_gives_node_order_results_and_cache(head_type, dtype):
  """Outputs come back in node order and `slot` finds each node's cache entries: what a pass
  over the block as listed gives, bit for bit in bfloat16 (each query still reads its keys in
  logical order), and to float32's rounding in float32 (the block's keys sum in another
  order)."""
  model = _model(head_type, dtype)
  tree = trees.with_lookup(trees.tree_from_choices([(0,), (1,), (0, 0)]), 4)
  assert list(trees.attention_order(tree)) != list(range(tree.num_nodes))
  b, prompt = 2, 11
  lengths = jnp.full((b,), prompt, jnp.int32)
  _, cache = model.step(jnp.asarray(testing.random_tokens((b, prompt), 61, seed=1)),
                        jnp.broadcast_to(jnp.arange(prompt), (b, prompt)),
                        model.init_cache(b, 64), jnp.zeros((b,), jnp.int32))
  nodes = jnp.asarray(testing.random_tokens((b, tree.num_nodes), 61, seed=2))
  positions = lengths[:, None] + jnp.asarray(tree.depth)[None]

  listed, listed_cache = jax.jit(lambda c: model.step(
      nodes, positions, c, lengths, block_mask=tree.attention_mask))(cache)
  ordered, ordered_cache, slot = jax.jit(lambda c: verification.step(
      model, tree, nodes, positions, c, lengths, with_heads=True))(cache)

  exact = dtype == 'bfloat16'
  for want, got in zip(jax.tree.leaves(listed), jax.tree.leaves(ordered)):
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    if exact:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  path = jnp.broadcast_to(jnp.asarray(tree.node_paths[-1]), (b, tree.max_depth + 1))
  layers = model.num_verified_cache_layers
  want = kv_cache.compact_layers(listed_cache, lengths, path, layers)
  got = kv_cache.compact_layers(ordered_cache, lengths, slot[path], layers)
  end = prompt + tree.max_depth + 1
  for w, g in zip(want.keys[:layers] + want.values[:layers],
                  got.keys[:layers] + got.values[:layers]):
    w = np.asarray(kv_cache.loaded(w, jnp.dtype(dtype)), np.float32)[:, :, :end]
    g = np.asarray(kv_cache.loaded(g, jnp.dtype(dtype)), np.float32)[:, :, :end]
    np.testing.assert_allclose(g, w, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
