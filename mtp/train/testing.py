"""Tiny trained workdirs for tests of everything downstream of training."""

from __future__ import annotations

import pathlib

import numpy as np
from flax import nnx

from configs import tiny
from mtp.parallel import mesh as mesh_lib
from mtp.train import step as step_lib
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


def counting_batch(seed: int, vocab_size: int = 32, rows: int = 8, length: int = 32):
  """Rows that count modulo `vocab_size` from random starts: token t+1+j is token t plus 1+j."""
  starts = np.random.default_rng(seed).integers(0, vocab_size, (rows, 1))
  return {'tokens': ((starts + np.arange(length)) % vocab_size).astype(np.int32),
          'segment_ids': np.ones((rows, length), np.int32),
          'positions': np.broadcast_to(np.arange(length), (rows, length)).astype(np.int32)}


def train_on_counting(config):
  """Trains `config` (vocabulary 32) for its steps on counting rows, one device: (eval metrics
  on held-out rows before, after, the trained model)."""
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1)))
  state = trainer.init_state()
  held_out = [counting_batch(10_000)]
  before = trainer.evaluate(state.params, held_out)
  for step in range(config.num_train_steps):
    state, _ = trainer.train_step(state, trainer.train_batch(counting_batch(step)))
  after = trainer.evaluate(state.params, held_out)
  return before, after, nnx.merge(trainer.graphdef, state.params)
