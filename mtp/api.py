"""The Python entry points: `mtp.load(workdir)`."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import ml_collections
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.data import tokenizer as tokenizer_lib
from mtp.model import mtp_model


@dataclasses.dataclass
class LoadedModel:
  """A trained model with what it needs to run: tokenizer, config, provenance."""
  model: mtp_model.MTPModel
  tokenizer: tokenizer_lib.Tokenizer
  config: ml_collections.ConfigDict
  step: int
  workdir: pathlib.Path


def load(workdir: str | os.PathLike, step: int | None = None,
         device: jax.Device | None = None) -> LoadedModel:
  """Loads the parameters of the latest (or the given) checkpoint of a training workdir.

  Raises:
    checkpointing.CheckpointError: the workdir, its config, tokenizer or checkpoint is missing
      or unreadable (the message names which).
  """
  workdir = pathlib.Path(workdir)
  config = checkpointing.load_config(workdir)
  if not (workdir / tokenizer_lib.FILENAME).exists():
    raise checkpointing.CheckpointError(f'{workdir / tokenizer_lib.FILENAME} does not exist.')
  tokenizer = tokenizer_lib.Tokenizer.load(workdir)
  model_config = mtp_model.ModelConfig.from_config(config.model)
  abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(model_config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract)
  checkpointer = checkpointing.Checkpointer(workdir, read_only=True)
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None:
      raise checkpointing.CheckpointError(f'{checkpointer.directory} holds no checkpoint.')
    if step not in checkpointer.all_steps():
      raise checkpointing.CheckpointError(
          f'{checkpointer.directory} has no step {step}; it has {checkpointer.all_steps()}.')
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          abstract_params)
    params, _ = checkpointer.restore(step, target)
  finally:
    checkpointer.close()
  return LoadedModel(model=nnx.merge(graphdef, params), tokenizer=tokenizer, config=config,
                     step=step, workdir=workdir)
