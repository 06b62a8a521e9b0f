"""The registry and the protocol: a family registered in one line trains and drafts through
MTPModel, has its FLOPs counted and its options in every config, and nothing outside its module
names it."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import base
from mtp.model import flops
from mtp.model import heads
from mtp.model import kv_cache as kv_cache_lib
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model import transformer
from mtp.train import flops as train_flops


class ScaledHeads(heads.HeadFamily):
  """A toy family: head k is norm(scale_k * normed). One option, no cache, no verification."""
  OPTIONS = {'scaled_start': 1.0}

  def __init__(self, trunk_cfg, num_heads, options, *, rngs):
    self.layers = nnx.List([transformer.rms_norm(trunk_cfg, rngs=rngs) for _ in range(num_heads)])
    self.start = options['scaled_start']

  @classmethod
  def validate_options(cls, options):
    if options['scaled_start'] <= 0:
      raise ValueError(f'model.scaled_start must be > 0, got {options["scaled_start"]}.')

  @classmethod
  def train_flops(cls, trunk_cfg, num_heads, options, batch_size, seq_len, count='causal'):
    # Its scaling is elementwise work, which model FLOPs leave out; it counts one FLOP per value
    # all the same, so that the tests see its own count arrive.
    values = num_heads * batch_size * seq_len * trunk_cfg.embed_dim
    return flops.HeadFlops(matmul=float(values), attention=0.0, remat_recompute=0.0)

  def __call__(self, trunk, hidden, normed, tokens, positions, mask):
    return [norm(normed * (self.start + k)) for k, norm in enumerate(self.layers)]

  def verify(self, hidden, normed, positions, block_mask, cache, lengths, first_layer):
    return {'normed': normed}, cache

  def draft(self, trunk, features, tokens, last_index, cache, lengths, depth, first_layer):
    normed = kv_cache_lib.gather_rows(features['normed'], last_index)
    return trunk.logits(jnp.stack([self.layers[k](normed * (self.start + k))
                                   for k in range(depth)])), cache


class UncountedHeads(heads.HeadFamily):
  """A family that implements no FLOP count (the rest does not matter here)."""


@pytest.fixture
def scaled_registered(monkeypatch):
  monkeypatch.setitem(heads.FAMILIES, 'scaled', ScaledHeads)


def test_the_registry_names_every_family():
  assert set(heads.FAMILIES) == {'eagle', 'medusa', 'parallel', 'sequential', 'streaming'}
  for family in heads.FAMILIES.values():
    assert issubclass(family, heads.HeadFamily)
  with pytest.raises(ValueError, match="Unknown model.mtp_head_type 'hydra'; expected one of "
                                       'eagle, medusa, parallel, sequential, streaming'):
    heads.family('hydra')


def test_a_registered_family_trains_and_drafts(scaled_registered):
  config = dict(vocab_size=61, embed_dim=32, num_layers=2, num_attention_heads=4,
                num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32, mtp_num_heads=2,
                mtp_head_type='scaled', scaled_start=2.0)
  cfg = mtp_model.ModelConfig.from_config(config)
  assert cfg.options == {'scaled_start': 2.0}
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(testing.random_tokens((2, 7), 61))
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  expected = model.logits(model(tokens, positions))
  assert expected.shape == (3, 2, 7, 61) and model.num_cache_layers == 2
  cache = model.init_cache(2, 16)
  lengths = jnp.zeros(2, jnp.int32)
  out, cache = model.step(tokens[:, :5], positions[:, :5], cache, lengths)
  last = jnp.asarray([4, 1])
  logits, _ = model.draft_logits(out.features, tokens, last, cache, lengths, depth=2)
  np.testing.assert_allclose(logits, expected[1:, [0, 1], [4, 1]], atol=1e-5, rtol=1e-5)


def test_a_family_checks_its_own_options(scaled_registered):
  cfg = mtp_model.ModelConfig(trunk=testing.tiny_config().trunk, mtp_num_heads=1,
                              mtp_head_type='scaled', head_options=(('scaled_start', 0.0),))
  with pytest.raises(ValueError, match='model.scaled_start must be > 0'):
    cfg.validate()


def test_a_registered_family_counts_its_own_flops(scaled_registered):
  config = base.get_config()
  config.model.mtp_head_type = 'scaled'
  counted = train_flops.train_step_flops(config)
  m, b, t = config.model, config.data.batch_size, config.data.seq_len
  assert counted.heads == 3 * m.mtp_num_heads * b * t * m.embed_dim  # Forward and backward.
  assert counted.remat_recompute == 0


def test_a_family_without_a_flop_count_is_named(monkeypatch):
  monkeypatch.setitem(heads.FAMILIES, 'uncounted', UncountedHeads)
  config = base.get_config()
  config.model.mtp_head_type = 'uncounted'
  with pytest.raises(train_flops.UnknownHeadFamily, match="head family 'uncounted'"):
    train_flops.train_step_flops(config)


def test_a_registered_family_options_are_config_keys_with_its_defaults(scaled_registered):
  assert base.get_config().model.scaled_start == 1.0
  # And flags override them, as they override every family's.
  argv = ['train', f'--config={pathlib.Path(base.__file__)}', '--config.model.scaled_start=3.0',
          '--config.model.medusa_num_layers=2']
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  assert flag_values.config.model.scaled_start == 3.0
  assert flag_values.config.model.medusa_num_layers == 2
