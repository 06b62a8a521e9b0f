"""Tiny trained workdirs for tests of everything downstream of training."""

from __future__ import annotations

import pathlib

from configs import tiny
from mtp.train import trainer as trainer_lib


def tiny_config(**overrides):
  """configs/tiny.py on one device, with dotted overrides: tiny_config(**{'optim.mode': ...})."""
  config = tiny.get_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split('.')
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


def train_tiny_workdir(path: str | pathlib.Path, num_train_steps: int = 2) -> pathlib.Path:
  """Trains configs/tiny.py on one device for a few steps into `path` (no evaluation)."""
  config = tiny.get_config()
  config.mesh.data = 1
  config.num_train_steps = num_train_steps
  config.eval_steps = 0
  trainer_lib.train_and_evaluate(config, path)
  return pathlib.Path(path)
