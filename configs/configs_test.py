"""Every config under configs/ (each size of those that take one) passes the checks training runs
first: a bad value in a shipped config fails here, not minutes into a run."""

import importlib
import pathlib

import pytest

from mtp.train import config_checks

_CONFIGS = sorted(p.stem for p in pathlib.Path(__file__).parent.glob('*.py')
                  if p.stem not in ('__init__', 'configs_test'))


def _variants():
  for name in _CONFIGS:
    module = importlib.import_module(f'configs.{name}')
    for size in getattr(module, 'SIZES', (None,)):
      yield pytest.param(module, size, id=f'{name}:{size}' if size else name)


@pytest.mark.parametrize('module,size', _variants())
def test_shipped_configs_are_valid(module, size):
  config = module.get_config() if size is None else module.get_config(size)
  config_checks.validate_config(config)
