"""Orbax checkpoints of training: parameters, optimizer state, step and data-iterator position.

Layout of a workdir:
  config.json            the full training config (written once, atomically)
  tokenizer.json         the tokenizer (written once)
  checkpoints/<step>/    params/, opt_state/, data/ (grain iterator state), written by Orbax
                         to a temporary directory and renamed when complete, so a crash never
                         leaves a half-written checkpoint under a step's name.

Heads trained on a frozen pretrained trunk (`init_from` + `optim.mode='frozen_trunk'`) save
only the heads: `base.json` then names the base workdir whose latest checkpoint holds the trunk.

Restoring the latest checkpoint resumes training exactly. A checkpoint that cannot be read is
reported by name and left untouched: nothing is written over it.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from mtp.data import pipeline

CONFIG_FILENAME = 'config.json'
CHECKPOINT_DIRNAME = 'checkpoints'
BASE_FILENAME = 'base.json'


class CheckpointError(RuntimeError):
  """A checkpoint is missing or unreadable."""


def write_json_atomically(path: pathlib.Path, obj: Any) -> None:
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))
  os.replace(tmp, path)


def _jsonable(value):
  if isinstance(value, tuple):
    return list(value)
  raise TypeError(f'{type(value).__name__} is not JSON serialisable')


def save_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Writes config.json (process 0 only)."""
  if jax.process_index() == 0:
    write_json_atomically(pathlib.Path(workdir) / CONFIG_FILENAME, config.to_dict())


def load_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  path = pathlib.Path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise CheckpointError(f'{path} does not exist: {workdir} is not an mtp workdir.')
  try:
    return ml_collections.ConfigDict(json.loads(path.read_text()))
  except json.JSONDecodeError as e:
    raise CheckpointError(f'{path} is not valid JSON ({e}).') from e


def write_base_reference(workdir: str | os.PathLike, base: str | os.PathLike) -> None:
  """Records that the checkpoints hold heads only, on the trunk of workdir `base`."""
  if jax.process_index() == 0:
    write_json_atomically(pathlib.Path(workdir) / BASE_FILENAME,
                          {'base_workdir': str(pathlib.Path(base).absolute()),
                           'checkpoints_hold': 'heads'})


def base_reference(workdir: str | os.PathLike) -> pathlib.Path | None:
  """The base workdir holding the trunk, if the checkpoints hold heads only."""
  path = pathlib.Path(workdir) / BASE_FILENAME
  if not path.exists():
    return None
  try:
    base = pathlib.Path(json.loads(path.read_text())['base_workdir'])
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f'{path} is unreadable ({e}).') from e
  if not (base / CONFIG_FILENAME).exists():
    raise CheckpointError(f'{workdir} holds heads on the trunk of {base}, which is not an mtp '
                          'workdir any more.')
  return base


class Checkpointer:
  """Saves and restores train state plus data iterator under `workdir/checkpoints`."""

  def __init__(self, workdir: str | os.PathLike, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = pathlib.Path(workdir).absolute() / CHECKPOINT_DIRNAME
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=not read_only,
        read_only=read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params, opt_state, data_iterator=None, force: bool = False) -> bool:
    """Starts saving (asynchronously); the data iterator's state is captured now."""
    items = dict(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state))
    if data_iterator is not None:
      items['data'] = pipeline.iterator_checkpoint_args(data_iterator)
    return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

  def save_params(self, step: int, params) -> bool:
    """Saves parameters alone (an imported model has no optimizer state or data position);
    `restore` without an optimizer state reads them."""
    return self._manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                              force=True)

  def restore(self, step: int, abstract_params, abstract_opt_state=None, data_iterator=None):
    """Restores the given items at `step` into the shapes and shardings of the abstract trees.

    Returns (params, opt_state or None); `data_iterator` is restored in place.
    """
    items = dict(params=ocp.args.StandardRestore(abstract_params))
    if abstract_opt_state is not None:
      items['opt_state'] = ocp.args.StandardRestore(abstract_opt_state)
    if data_iterator is not None:
      items['data'] = pipeline.iterator_checkpoint_args(data_iterator, restore=True)
    path = self.directory / str(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax raises many types for unreadable files.
      raise CheckpointError(
          f'Checkpoint {path} could not be restored ({type(e).__name__}: {e}). It was left '
          'untouched; move it away to resume from an earlier step.') from e
    return restored['params'], restored.get('opt_state') if abstract_opt_state else None

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_with_shardings(tree, shardings):
  """ShapeDtypeStructs carrying shardings, as Orbax wants for a sharded restore."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)

