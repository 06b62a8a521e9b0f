"""A workdir's checkpoint converted to the other layer layout, so that training resumes in it.

Loading (`mtp.load`, generation, export, `init_from`) reads either layout by itself; resuming
training does not (`mtp.model.layout.LayoutMismatchError`), because the optimizer state mirrors
the parameters' layout. `convert_workdir` writes a new workdir whose latest checkpoint holds the
parameters, the optimizer state (both with the trunk's layers stacked or unstacked by
`layout.to_layout`) and the data position of the source's, and whose config says the new
layout. The source is only read; the output's lock (`<output>.lock`, `workdir_lock`, the one a
trainer of it would take) is held while it is written.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.checkpoint import workdir_lock
from mtp.model import layout

_TREES = ('params', 'opt_state')
_FINGERPRINTS = 'fingerprints'
# Files of a workdir that carry over unchanged (the tokenizer and its companions, base.json,
# the metrics so far, cached head accuracies).
_CARRIED_FILES = ('tokenizer.json', 'special_tokens.json', 'chat_template.jinja',
                  checkpointing.BASE_FILENAME, 'metrics.jsonl', 'head_accuracies.json')


def convert_workdir(workdir: str | os.PathLike, output: str | os.PathLike,
                    scan_layers: bool) -> int:
  """Writes `output`: workdir's latest checkpoint with the trunk's layers in the given layout.

  Returns:
    The checkpoint's step.

  Raises:
    checkpointing.CheckpointError: no workdir, or no checkpoint in it.
    ValueError: `output` exists, the workdir is in that layout already, or either is a URL
      (`gs://...`: local paths only).
    workdir_lock.WorkdirLockedError: another process writes `output`.
  """
  # Local files only, for now: a URL is refused by name, never folded into a local path.
  workdir = paths.local_path(workdir, '--workdir')
  output = paths.local_path(output, '--output')
  config = checkpointing.load_config(workdir)
  if bool(config.model.get('scan_layers', False)) == scan_layers:
    raise ValueError(f'{workdir} is {layout.layout_name(scan_layers)} already '
                     f'(model.scan_layers={scan_layers}).')
  _check_output(output)
  with workdir_lock.WorkdirLock(output):
    _check_output(output)  # Still free now that it is ours.
    return _convert(workdir, output, config, scan_layers)


def _check_output(output: pathlib.Path) -> None:
  if output.exists():
    raise ValueError(f'{output} exists: the conversion writes a new workdir.')


def _convert(workdir: pathlib.Path, output: pathlib.Path, config, scan_layers: bool) -> int:
  """`convert_workdir` once the output's lock is held."""
  source = checkpointing.Checkpointer(workdir, read_only=True)
  try:
    steps = source.all_steps()
    if not steps:
      raise checkpointing.CheckpointError(f'{source.directory} holds no checkpoint.')
    step = max(steps)
    trees = _read_trees(source, step)
  finally:
    source.close()
  converted = {name: layout.to_layout(tree, scan_layers, layer_key=str)
               for name, tree in trees.items()}

  # Staging siblings of conversions to this output that were killed: stale, as the lock is ours.
  for stale in output.parent.glob(f'.{output.name}.converting-*'):
    shutil.rmtree(stale, ignore_errors=True)
  staging = output.with_name(f'.{output.name}.converting-{os.getpid()}')
  try:
    staging.mkdir(parents=True)
    with config.unlocked():
      config.model.scan_layers = scan_layers
    checkpointing.save_config(staging, config)
    for name in _CARRIED_FILES:
      if (workdir / name).is_file():
        shutil.copyfile(workdir / name, staging / name)
    target = checkpointing.Checkpointer(staging, max_to_keep=1, async_save=False)
    try:
      _write_trees(target, step, converted)
    finally:
      target.close()
    # The other items (the data position) do not depend on the layout: copied as they are.
    source_step = workdir / checkpointing.CHECKPOINT_DIRNAME / str(step)
    target_step = staging / checkpointing.CHECKPOINT_DIRNAME / str(step)
    for item in source_step.iterdir():
      if item.is_dir() and not (target_step / item.name).exists():
        shutil.copytree(item, target_step / item.name)
    os.rename(staging, output)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return step


def _read_trees(checkpointer: checkpointing.Checkpointer, step: int) -> dict:
  """The saved trees of `step` in their own structure (arrays on one device)."""
  path = checkpointer.directory / str(step)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  args = {}
  for name in _TREES:
    if not (path / name).exists():
      continue
    handler = ocp.StandardCheckpointHandler()
    try:
      metadata = handler.metadata(path / name).tree
    finally:
      handler.close()
    args[name] = ocp.args.StandardRestore(jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), metadata))
  # pylint: disable-next=protected-access
  restored = checkpointer._manager.restore(step, args=ocp.args.Composite(**args))
  return {name: restored[name] for name in args}


def _write_trees(checkpointer: checkpointing.Checkpointer, step: int, trees: dict) -> None:
  """Saves the trees with their fingerprints, as `Checkpointer.save` does."""
  items = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
  # pylint: disable-next=protected-access
  items[_FINGERPRINTS] = checkpointing._fingerprints_args(**trees)
  # pylint: disable-next=protected-access
  checkpointer._manager.save(step, args=ocp.args.Composite(**items), force=True)
