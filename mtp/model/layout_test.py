"""Layer layouts: conversions round-trip; a scanned trunk computes what its unrolled twin does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.model import layout
from mtp.model import mtp_model
from mtp.model import testing


def _unrolled_tree(num_layers=3):
  rng = np.random.default_rng(0)
  def layer():
    return {'attn': {'kernel': rng.normal(size=(4, 2))}, 'norm': {'scale': rng.normal(size=4)}}
  return {'trunk': {'embedding': rng.normal(size=(5, 4)),
                    'blocks': {i: layer() for i in range(num_layers)}},
          'heads': {'layers': {0: {'w': rng.normal(size=3)}}}}


def test_stack_then_unstack_round_trips_and_leaves_the_input_alone():
  tree = _unrolled_tree()
  stacked = layout.to_layout(tree, scan_layers=True)
  assert layout.tree_layout(stacked) == layout.SCANNED
  assert layout.tree_layout(tree) == layout.UNROLLED  # Pure: the input is unchanged.
  assert stacked['trunk']['blocks']['attn']['kernel'].shape == (3, 4, 2)
  np.testing.assert_array_equal(stacked['trunk']['blocks']['attn']['kernel'][2],
                                tree['trunk']['blocks'][2]['attn']['kernel'])
  assert stacked['heads'] is not tree['heads'] and stacked['heads']['layers'][0]['w'] is (
      tree['heads']['layers'][0]['w'])  # Outside the trunk's blocks nothing changes.
  back = layout.to_layout(stacked, scan_layers=False)
  jax.tree.map(np.testing.assert_array_equal, back, tree)
  assert layout.to_layout(stacked, scan_layers=True)['trunk']['blocks'].keys() == (
      stacked['trunk']['blocks'].keys())


def test_every_trunk_in_an_optimizer_state_like_tree_is_converted_with_string_keys():
  tree = {'0': {'mu': _unrolled_tree(2), 'nu': _unrolled_tree(2)}, 'count': np.zeros(())}
  flat = layout.flatten(layout.to_layout(tree, True))
  assert ('0', 'nu', 'trunk', 'blocks', 'attn', 'kernel') in flat
  back = layout.to_layout(layout.nest(flat), False, layer_key=str)
  assert set(back['0']['mu']['trunk']['blocks']) == {'0', '1'}


def test_abstract_leaves_keep_an_unsharded_layer_axis():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ('fsdp',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp', None))
  leaf = jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=sharding)
  stacked = layout.stack_layers({'0': {'w': leaf}, '1': {'w': leaf}})['w']
  assert stacked.shape == (2, 4, 2)
  assert stacked.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', None)
  assert layout.unstack_layers({'w': stacked})[1]['w'].sharding.spec == sharding.spec


def test_bad_layers_are_named():
  with pytest.raises(ValueError, match='0..L-1'):
    layout.stack_layers({0: {'w': np.zeros(2)}, 2: {'w': np.zeros(2)}})
  with pytest.raises(ValueError, match='another structure'):
    layout.stack_layers({0: {'w': np.zeros(2)}, 1: {'v': np.zeros(2)}})
  with pytest.raises(ValueError, match='disagree'):
    layout.unstack_layers({'w': np.zeros((2, 3)), 'v': np.zeros((3, 3))})


def test_bad_settings_are_named():
  cfg = testing.tiny_config().trunk
  with pytest.raises(ValueError, match='model.scan_layers must be true or false'):
    dataclasses.replace(cfg, scan_layers='yes').validate()
  with pytest.raises(ValueError, match='dots_saveable'):
    dataclasses.replace(cfg, remat='dots').validate()


def _inputs(b=2, t=12):
  tokens = jnp.asarray(testing.random_tokens((b, t), 61, seed=3))
  segments = jnp.asarray(np.repeat([[1] * (t // 2) + [2] * (t - t // 2)], b, 0), jnp.int32)
  return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), segments


@pytest.mark.parametrize('head_type,remat', [('medusa', 'none'), ('parallel', 'full'),
                                             ('sequential', 'dots_saveable')])
def test_scanned_trunk_matches_unrolled_forward_loss_and_grad(head_type, remat):
  cfg = testing.tiny_config(head_type=head_type, num_layers=3)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, remat=remat))
  unrolled = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(1))
  scanned = layout.with_layout(unrolled, scan_layers=True)
  assert scanned.cfg.trunk.scan_layers and layout.tree_layout(
      nnx.to_pure_dict(nnx.state(scanned))) == layout.SCANNED
  inputs = _inputs()

  def forward_and_grad(model):
    graphdef, params = nnx.split(model)

    def loss(p):
      merged = nnx.merge(graphdef, p)
      hidden = merged(*inputs)  # [K+1, B, T, D]
      logits = merged.logits(hidden)
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), hidden
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  (loss_u, hidden_u), grad_u = forward_and_grad(unrolled)
  (loss_s, hidden_s), grad_s = forward_and_grad(scanned)
  np.testing.assert_allclose(hidden_s, hidden_u, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  grad_s = layout.to_layout(nnx.to_pure_dict(grad_s), scan_layers=False)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), grad_s,
               nnx.to_pure_dict(grad_u))


def test_scanned_cached_steps_match_unrolled_ones_and_write_the_same_cache():
  unrolled = testing.tiny_model(head_type='parallel', num_layers=3)
  scanned = layout.with_layout(unrolled, scan_layers=True)
  tokens, positions, _ = _inputs()

  @jax.jit
  def two_steps(graphdef, params):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(2, 32)
    lengths = jnp.zeros(2, jnp.int32)
    first, cache = model.step(tokens[:, :7], positions[:, :7], cache, lengths)
    second, cache = model.step(tokens[:, 7:], positions[:, 7:], cache, lengths + 7)
    return first.normed, second.normed, second.features, cache
  outs = [two_steps(*nnx.split(model)) for model in (unrolled, scanned)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5), *outs)
