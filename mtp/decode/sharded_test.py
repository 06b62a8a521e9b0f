"""Speculative decoding sharded over 8 simulated CPU devices gives the one-device tokens.

Parameters are sharded by their logical axes over a (data=2, fsdp=2, tensor=2) mesh, prompts
and the KV cache by rows over (data, fsdp) (and KV heads over tensor): the whole loop runs
under one jit across the mesh.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import testing
from mtp.parallel import mesh as mesh_lib

PROMPT_LENGTHS = np.array([7, 3, 5, 6], np.int32)
MAX_NEW = 16
TREE = trees.tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


@pytest.fixture(scope='module')
def mesh():
  if jax.device_count() < 8:
    pytest.skip('needs 8 devices (conftest.py simulates them on CPU)')
  return mesh_lib.make_mesh(dict(data=2, fsdp=2, tensor=2))


# A seed's random drafter must have some drafts accepted, else equal acceptance would say
# nothing about the drafts (EAGLE-3's at seed 0 has none accepted; at seed 2 some, to depth 3).
@pytest.mark.parametrize('head_type,tree,budget,seed', [
    ('medusa', TREE, 0, 0), ('parallel', None, 0, 0), ('sequential', TREE, 4, 0),
    ('streaming', TREE, 0, 0), ('eagle3', TREE, 0, 2)],
    ids=['medusa-tree', 'parallel-chain', 'sequential-dynamic-tree', 'streaming-tree',
         'eagle3-tree'])
def test_sharded_loop_gives_the_one_device_tokens(mesh, head_type, tree, budget, seed):
  # Two KV heads and 64 ids: 'tensor' divides both.
  model = decode_testing.head_model(head_type, seed, vocab_size=64)
  prompts = testing.random_tokens((4, 7), 64, seed=1)
  expected = decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                                   tree=tree, tree_budget=budget)
  assert np.asarray(expected.accepted_histogram)[:, 2:].sum() > 0, 'no draft was accepted'

  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, mesh_lib.state_shardings(state, mesh)))
  sharded_leaves = [x for x in jax.tree.leaves(nnx.state(model))
                    if not x.sharding.is_fully_replicated]
  assert sharded_leaves, 'no parameter is sharded: the test would prove nothing'

  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, tree=tree,
                              tree_budget=budget, mesh=mesh)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_steps, expected.num_steps)
  np.testing.assert_array_equal(out.accepted_histogram, expected.accepted_histogram)

  # The loop state really is spread over the mesh: rows over (data, fsdp), the cache's KV
  # heads over tensor, each device holding a quarter of the rows.
  engine = decode_testing.engine(model, max_new_tokens=MAX_NEW, tree=tree, mesh=mesh)
  loop_state = engine.prefill(prompts, PROMPT_LENGTHS, decode_testing.settings(
      engine, 4, max_new_tokens=MAX_NEW))
  keys = loop_state.cache.keys[0]  # [B, G, S, H]
  assert keys.sharding.spec[0] == mesh_lib.BATCH_AXES
  assert keys.sharding.spec[1] == 'tensor'
  assert keys.addressable_shards[0].data.shape == (1, 1) + keys.shape[2:]
  assert not loop_state.lengths.sharding.is_fully_replicated
