"""MTP model: head families' shapes, cached steps and drafts equal training, config errors."""

import dataclasses

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from mtp.model import heads
from mtp.model import mtp_model
from mtp.model import testing

HEAD_TYPES = tuple(heads.FAMILIES)
# Option variants of a family that change its drafting path: name -> (family, options).
VARIANTS = {
    'eagle3': ('eagle', {'eagle_features': 'fused', 'eagle_input': 'concat'}),
    'eagle-fused-fc': ('eagle', {'eagle_features': 'fused', 'eagle_fused_layers': '1'}),
    'eagle-last-concat': ('eagle', {'eagle_input': 'concat'}),
}


def _variant_model(name, **kwargs):
  """testing.tiny_model of a family name or of a `VARIANTS` name."""
  family, options = VARIANTS.get(name, (name, {}))
  if not options:
    return testing.tiny_model(head_type=family, **kwargs)
  cfg = dataclasses.replace(testing.tiny_config(head_type=family, **kwargs),
                            head_options=tuple(sorted(options.items())))
  return mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))


def _positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


@pytest.mark.parametrize('head_type,cache_layers,verified', [
    ('medusa', 2, 2), ('parallel', 5, 5), ('sequential', 5, 2)])
def test_training_forward_shapes(head_type, cache_layers, verified):
  model = testing.tiny_model(head_type=head_type, mtp_num_heads=3)
  tokens = jnp.asarray(testing.random_tokens((2, 9), 61))
  out = model(tokens, _positions(2, 9))
  assert out.shape == (4, 2, 9, 32)
  assert model.logits(out).shape == (4, 2, 9, 61)
  assert model.mtp_num_heads == 3
  assert model.num_cache_layers == cache_layers
  assert model.num_verified_cache_layers == verified
  assert model.init_cache(2, 16).num_layers == cache_layers


def test_no_heads_is_a_plain_language_model():
  model = testing.tiny_model(mtp_num_heads=0)
  out = model(jnp.zeros((1, 4), jnp.int32), _positions(1, 4))
  assert out.shape == (1, 1, 4, 32)
  assert model.num_cache_layers == model.num_verified_cache_layers == 2


@pytest.mark.parametrize('head_type', HEAD_TYPES + tuple(VARIANTS))
def test_cached_steps_and_drafts_equal_training(head_type):
  """Prefill, draft, verification step, draft: each head's draft logits equal the training
  forward's on the same text, where the text holds the drafts that a chain of sequential modules
  fed to its later modules (they stand for tokens not yet known)."""
  k, b = 3, 2
  model = _variant_model(head_type, mtp_num_heads=k)
  tokens = testing.random_tokens((b, 16), 61, seed=1)
  cache = model.init_cache(b, 32)
  drafts = []
  # (first slot, tokens in the step, index of the last accepted token per row)
  for start, n, last in [(0, 6, [5, 5]), (6, 6, [5, 2])]:
    lengths = jnp.full(b, start, jnp.int32)
    out, cache = model.step(jnp.asarray(tokens[:, start:start + n]), _positions(b, n, start),
                            cache, lengths)
    logits, cache = model.draft_logits(out.features, jnp.asarray(tokens[:, start:start + n + k]),
                                       jnp.asarray(last), cache, lengths, depth=k)
    assert logits.shape == (k, b, 61)
    for row in range(b):
      position = start + last[row]
      drafts.append((row, position, logits[:, row], model.logits(out.normed[row, :last[row] + 1])))
      for d in range(k - 1):  # Head d + 1's top-1 becomes token position + 2 + d.
        tokens[row, position + 2 + d] = int(jnp.argmax(logits[d, row]))
  expected = model.logits(model(jnp.asarray(tokens), _positions(b, 16)))  # [K+1, B, T, V]
  for row, position, logits, trunk_logits in drafts:
    np.testing.assert_allclose(logits, expected[1:, row, position], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(trunk_logits, expected[0, row, position + 1 - len(trunk_logits):
                                                      position + 1], atol=1e-4, rtol=1e-4)


def test_steps_without_heads_write_the_trunk_layers_only():
  model = testing.tiny_model(head_type='parallel')
  cache = model.init_cache(1, 8)
  out, cache = model.step(jnp.ones((1, 3), jnp.int32), _positions(1, 3), cache,
                          jnp.zeros(1, jnp.int32), with_heads=False)
  assert out.features is None
  assert all(not jnp.any(keys) for keys in cache.keys[2:])
  assert all(jnp.any(keys) for keys in cache.keys[:2])


def test_medusa_heads_start_as_the_trunk():
  model = mtp_model.MTPModel(testing.tiny_config(head_type='medusa'), rngs=nnx.Rngs(0))
  out = model(jnp.ones((1, 5), jnp.int32), _positions(1, 5))
  for k in range(1, 4):
    np.testing.assert_array_equal(out[k], out[0])


def test_family_options_come_from_the_config():
  config = dict(vocab_size=61, embed_dim=32, num_layers=1, num_attention_heads=4, num_kv_heads=2,
                head_dim=8, mlp_dim=64, max_seq_len=32, mtp_num_heads=2, mtp_head_type='medusa',
                medusa_num_layers=2)
  model = mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config), rngs=nnx.Rngs(0))
  assert [len(head.blocks) for head in model.heads.layers] == [2, 2]
  del config['medusa_num_layers']
  assert mtp_model.ModelConfig.from_config(config).options == {'medusa_num_layers': 1}


@pytest.mark.parametrize('change,message', [
    (dict(mtp_head_type='hydra'), "Unknown model.mtp_head_type 'hydra'"),
    (dict(mtp_num_heads=-1), 'mtp_num_heads must be >= 0'),
    (dict(head_options=(('medusa_num_layers', 0),)), 'medusa_num_layers must be >= 1'),
])
def test_bad_head_config_is_named(change, message):
  cfg = dataclasses.replace(testing.tiny_config(), **change)
  with pytest.raises(ValueError, match=message):
    mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('as_config_dict', [False, True])
def test_legacy_config_key_is_upgraded(as_config_dict):
  config = {'model': {'num_heads': 9, 'num_kv_heads': 3, 'mtp_num_heads': 4}, 'seed': 0}
  if as_config_dict:
    config = ml_collections.ConfigDict(config)
  upgraded = mtp_model.upgrade_legacy_config(config)
  assert dict(upgraded['model']) == {'num_attention_heads': 9, 'num_kv_heads': 3,
                                     'mtp_num_heads': 4}
  assert mtp_model.upgrade_legacy_config(upgraded)['model']['num_attention_heads'] == 9


def test_trunk_config_reads_the_legacy_key():
  fields = dict(vocab_size=61, embed_dim=32, num_layers=1, num_kv_heads=2, head_dim=8,
                mlp_dim=64, max_seq_len=32)
  legacy = mtp_model.transformer.TransformerConfig.from_config({**fields, 'num_heads': 4})
  assert legacy.num_attention_heads == 4
