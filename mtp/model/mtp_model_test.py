"""MTP model: head families' shapes, cached heads equal training heads, config errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.model import mtp_model
from mtp.model import testing

HEAD_TYPES = ('medusa', 'parallel', 'sequential')


def _positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


@pytest.mark.parametrize('head_type', HEAD_TYPES)
def test_training_forward_shapes(head_type):
  model = testing.tiny_model(head_type=head_type, num_heads=3)
  tokens = jnp.asarray(testing.random_tokens((2, 9), 61))
  out = model(tokens, _positions(2, 9))
  assert out.shape == (4, 2, 9, 32)
  assert model.logits(out).shape == (4, 2, 9, 61)
  expected_layers = 2 + (0 if head_type == 'medusa' else 3)
  assert model.num_cache_layers == expected_layers
  assert model.init_cache(2, 16).num_layers == expected_layers


def test_no_heads_is_a_plain_language_model():
  model = testing.tiny_model(num_heads=0)
  out = model(jnp.zeros((1, 4), jnp.int32), _positions(1, 4))
  assert out.shape == (1, 1, 4, 32)


@pytest.mark.parametrize('head_type', ['medusa', 'parallel'])
def test_cached_step_heads_equal_training_heads(head_type):
  model = testing.tiny_model(head_type=head_type)
  tokens = jnp.asarray(testing.random_tokens((2, 10), 61, seed=1))
  expected = model(tokens, _positions(2, 10))
  cache = model.init_cache(2, 16)
  first, cache = model.step(tokens[:, :6], _positions(2, 6), cache, jnp.zeros(2, jnp.int32))
  second, _ = model.step(tokens[:, 6:], _positions(2, 4, 6), cache, jnp.full(2, 6))
  heads = jnp.concatenate([first.head_normed, second.head_normed], axis=2)
  np.testing.assert_allclose(heads, expected[1:], atol=1e-4, rtol=1e-4)


def test_sequential_module_steps_equal_training_chain():
  model = testing.tiny_model(head_type='sequential')
  tokens = jnp.asarray(testing.random_tokens((1, 12), 61, seed=2))
  expected = model(tokens, _positions(1, 12))
  t = 8  # positions whose x_{t+k} all lie inside the sequence for k <= 3
  cache = model.init_cache(1, 16)
  lengths = jnp.zeros(1, jnp.int32)
  out, cache = model.step(tokens[:, :t], _positions(1, t), cache, lengths)
  h = out.hidden
  for k in range(3):
    h, normed, cache = model.sequential_module_step(k, h, tokens[:, k + 1:k + 1 + t],
                                                    _positions(1, t), cache, lengths)
    np.testing.assert_allclose(normed, expected[k + 1, :, :t], atol=1e-4, rtol=1e-4)


def test_medusa_heads_start_as_the_trunk():
  model = mtp_model.MTPModel(testing.tiny_config(head_type='medusa'), rngs=nnx.Rngs(0))
  out = model(jnp.ones((1, 5), jnp.int32), _positions(1, 5))
  for k in range(1, 4):
    np.testing.assert_array_equal(out[k], out[0])


@pytest.mark.parametrize('change,message', [
    (dict(mtp_head_type='eagle'), "Unknown model.mtp_head_type 'eagle'"),
    (dict(mtp_num_heads=-1), 'mtp_num_heads must be >= 0'),
    (dict(medusa_num_layers=0), 'medusa_num_layers must be >= 1'),
])
def test_bad_head_config_is_named(change, message):
  cfg = dataclasses.replace(testing.tiny_config(), **change)
  with pytest.raises(ValueError, match=message):
    mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
