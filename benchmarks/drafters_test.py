"""benchmarks.drafters: every variant is a valid training config on both trunks it runs on."""

import pytest
from absl import flags
from absl.testing import flagsaver

from benchmarks import drafters
from configs import code_small
from configs import smollm2_heads
from mtp.train import config_checks

FLAGS = flags.FLAGS


def _as_type_of(old, value):
  """A --config.KEY=VALUE string read as the type of the value it replaces, as absl does."""
  if not isinstance(value, str) or isinstance(old, str):
    return value
  if isinstance(old, bool):
    return {'true': True, 'false': False}[value.lower()]
  return type(old)(value)


@pytest.mark.parametrize('variant', sorted(drafters.VARIANTS))
@pytest.mark.parametrize('base', [code_small, smollm2_heads], ids=['code_small', 'smollm2'])
@flagsaver.flagsaver
def test_every_variant_is_a_valid_config(variant, base):
  """A renamed option or a refused combination fails here, not an hour into a benchmark run."""
  FLAGS.unparse_flags()
  FLAGS(['drafters'])
  config = base.get_config()
  for key, value in drafters.head_overrides('workdirs/trunk', variant).items():
    target = config
    *parents, leaf = key.split('.')
    for parent in parents:
      target = target[parent]
    assert leaf in target, f'--config.{key}: no such key'  # As the command line refuses it.
    target[leaf] = _as_type_of(target[leaf], value)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  config_checks.validate_config(config)
