"""The train state a run starts from: fresh, resumed from its workdir, or on the trunk of a
pretrained workdir (`init_from`)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import param_tree
from mtp.train import config_checks
from mtp.train import step as step_lib


def saves_heads_only(config: ml_collections.ConfigDict) -> bool:
  """A frozen pretrained trunk is already saved in its own workdir: keep only the heads."""
  return bool(config.get('init_from')) and config.optim.mode == 'frozen_trunk'


def saved_params(config: ml_collections.ConfigDict, params: nnx.State) -> nnx.State:
  """What a checkpoint of this run holds of `params`."""
  return param_tree.select(params, [param_tree.HEADS]) if saves_heads_only(config) else params


def initial_state(config: ml_collections.ConfigDict, workdir: pathlib.Path,
                  trainer: step_lib.Trainer, checkpointer: checkpointing.Checkpointer,
                  data_iterator, heads: nnx.State | None = None
                  ) -> tuple[step_lib.TrainState, int]:
  """(The state to train from, its step): the workdir's latest checkpoint, with the data
  iterator restored in place; else the init_from trunk under fresh heads, or under `heads`
  (`pretrained_heads`); else fresh."""
  start_step = checkpointer.latest_step() or 0
  if start_step:
    abstract = trainer.abstract_state_with_shardings()
    if saves_heads_only(config):  # The frozen trunk comes from the base workdir, as at step 0.
      check_same_trunk(config.init_from, trainer)
    params, _ = checkpointing.restore_params(workdir, abstract.params, step=start_step)
    _, opt_state = checkpointer.restore(start_step, opt_state=abstract.opt_state,
                                        data_iterator=data_iterator)
    state = step_lib.TrainState(step=jax.device_put(jnp.asarray(start_step, jnp.int32),
                                                    trainer.state_shardings.step),
                                params=params, opt_state=opt_state)
    logging.info('Resumed from step %d in %s.', start_step, workdir)
    return state, start_step
  if config.get('init_from'):
    state = trainer.init_state(trunk=pretrained_trunk(config.init_from, trainer))
    logging.info('Initialised the trunk from %s.', config.init_from)
  else:
    state = trainer.init_state()
  if heads is not None:
    state = state.replace(params=param_tree.replace(state.params, heads))
    logging.info('Initialised the heads from %s.', config.init_heads_from)
  return state, 0


def pretrained_heads(config: ml_collections.ConfigDict, trainer: step_lib.Trainer,
                     workdir: pathlib.Path) -> nnx.State | None:
  """The heads of workdir `init_heads_from` (its latest step) for a fresh run in `workdir`;
  None where it is not set or the run resumes (its own checkpoint has its heads).

  Raises:
    CheckpointError: it has no checkpoint, or none with heads of the configured shapes.
  """
  source = config.get('init_heads_from')
  if not source:
    return None
  own = checkpointing.Checkpointer(workdir, read_only=True)
  try:
    if own.latest_step():
      return None
  finally:
    own.close()
  target = trainer.abstract_state_with_shardings().params
  heads, _ = checkpointing.restore_params(source, target, parts=[param_tree.HEADS])
  return heads


def pretrained_trunk(source: str | pathlib.Path, trainer: step_lib.Trainer) -> nnx.State:
  """The trunk of workdir `source` (its latest step), placed with the trainer's shardings, for
  `trainer.init_state(trunk=...)`.

  The source may have other heads or none; its trunk must have the same shape.
  """
  check_same_trunk(source, trainer)
  target = trainer.abstract_state_with_shardings().params
  trunk, _ = checkpointing.restore_params(source, target, parts=[param_tree.TRUNK])
  return trunk


def check_same_trunk(source: str | pathlib.Path, trainer: step_lib.Trainer) -> None:
  """Raises ValueError unless workdir `source` has the configured trunk (runtime settings
  aside)."""
  config_checks.check_same_trunk(source, trainer.model_config.trunk)
