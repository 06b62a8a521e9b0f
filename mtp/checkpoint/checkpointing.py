"""Orbax checkpoints of training: parameters, optimizer state, step and data-iterator position.

Layout of a workdir:
  config.json            the full training config (written once, atomically)
  tokenizer.json         the tokenizer (written once)
  checkpoints/<step>/    params/, opt_state/, data_position/ (global batches consumed, any
                         process count restores it; older ones: data/, grain's), written by Orbax
                         to a temporary directory and renamed when complete, so a crash never
                         leaves a half-written checkpoint under a step's name.

Heads trained on a frozen pretrained trunk (`init_from` + `optim.mode='frozen_trunk'`) save
only the heads: `base.json` then names the base workdir whose latest checkpoint holds the trunk
(relative to the heads workdir when the two sit near each other, so the pair can be moved).

Restoring the latest checkpoint resumes training exactly. A checkpoint that cannot be read is
reported by name in one line (the reader's detail, TensorStore's kilobytes of it, goes to the
debug log: --verbosity=1) and left untouched: nothing is written over it. Training stops there,
naming the step it would resume from once that checkpoint is moved away (resuming from an
earlier step by itself would collide with the unreadable step's directory when it saves that
step again, and would throw progress away on a read that failed for a passing reason); loading
parameters of the latest step (`restore_params` without a step: generation, serving, init_from)
falls back to the newest checkpoint that restores, with a warning naming both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from mtp.checkpoint import fingerprint
from mtp.checkpoint import param_tree
from mtp.checkpoint import paths
from mtp.model import heads as heads_lib
from mtp.model import layout
from mtp.model import mtp_model
from mtp.model import transformer

CONFIG_FILENAME = 'config.json'
CHECKPOINT_DIRNAME = 'checkpoints'
BASE_FILENAME = 'base.json'
DRAFT_IDS_FILENAME = 'draft_vocab.json'  # The heads' draft vocabulary (mtp_head_draft_vocab).


class CheckpointError(RuntimeError):
  """A checkpoint is missing or unreadable."""


class UnreadableCheckpointError(CheckpointError):
  """A checkpoint whose files do not read back (truncated, corrupt); `path` names it, `reason`
  says what failed in a few words."""

  def __init__(self, path, reason: str, older: int | None):
    self.path, self.reason = path, reason
    advice = (f'to resume from step {older}, the one before it, move it out of {path.parent}'
              if older is not None else 'there is no earlier checkpoint')
    super().__init__(f'Checkpoint {path} could not be restored ({reason}). It was left '
                     f'untouched; {advice} (--verbosity=1 logs the details).')


def _brief(error: BaseException, limit: int = 300) -> str:
  """`error` in one short line: its innermost cause's first line, as `Type: text` (Orbax wraps
  a TensorStore error whose own text holds the whole spec, kilobytes, around the one line that
  says what failed)."""
  seen = {id(error)}
  while True:
    inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if inner is None or id(inner) in seen:
      break
    error = inner
    seen.add(id(error))
  text = next((line.strip() for line in str(error).splitlines() if line.strip()), '')
  text = text.split(' See full TensorStore details')[0]
  if len(text) > limit:
    text = text[:limit - 3] + '...'
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def write_json_atomically(path: str | os.PathLike, obj: Any) -> None:
  paths.write_text_atomically(
      path, json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))


def _jsonable(value):
  if isinstance(value, tuple):
    return list(value)
  raise TypeError(f'{type(value).__name__} is not JSON serialisable')


def save_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Writes config.json (process 0 only)."""
  if jax.process_index() == 0:
    write_json_atomically(paths.as_path(workdir) / CONFIG_FILENAME, config.to_dict())


def save_draft_ids(workdir: str | os.PathLike, ids) -> None:
  """Writes the heads' draft vocabulary (`mtp_head_draft_vocab`) to the workdir (process 0).

  The heads score these ids only, so decoding and export must use exactly them; kept in the
  workdir, they no longer depend on counting a corpus that may have changed or be absent.
  """
  if jax.process_index() == 0:
    write_json_atomically(paths.as_path(workdir) / DRAFT_IDS_FILENAME,
                          {'ids': [int(i) for i in ids]})


def load_draft_ids(workdir: str | os.PathLike, vocab_size: int):
  """[N] int32 numpy: the draft vocabulary `save_draft_ids` kept, or None where there is none.

  Raises:
    CheckpointError: the file is not JSON, or its ids are not distinct ids in [0, vocab_size).
  """
  path = paths.as_path(workdir) / DRAFT_IDS_FILENAME
  if not path.exists():
    return None
  try:
    ids = json.loads(path.read_text())['ids']
  except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
    raise CheckpointError(f'{path} is not a draft vocabulary ({{"ids": [...]}}): '
                          f'{type(e).__name__}: {e}') from e
  if (not isinstance(ids, list) or not ids
      or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
    raise CheckpointError(f'{path}: "ids" must be a non-empty list of token ids.')
  array = np.asarray(ids, np.int64)
  if array.min() < 0 or array.max() >= vocab_size or np.unique(array).size != array.size:
    raise CheckpointError(f'{path}: the ids must be distinct and lie in [0, {vocab_size}) '
                          '(the model\'s vocabulary).')
  return array.astype(np.int32)


def load_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  path = paths.as_path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise CheckpointError(f'{path} does not exist: {workdir} is not an mtp workdir.')
  try:
    values = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f'{path} is not valid JSON ({e}).') from e
  if not isinstance(values, dict) or not isinstance(values.get('model'), dict):
    raise CheckpointError(f'{path} has no "model" section: it is not an mtp config.')
  values = mtp_model.upgrade_legacy_config(values)
  missing = [k for k in REQUIRED_MODEL_KEYS if k not in values['model']]
  if missing:
    raise CheckpointError(f'{path} lacks the model keys {", ".join(missing)}: it is damaged or '
                          'not an mtp config (configs/base.py documents every key).')
  return ml_collections.ConfigDict(values)


# The trunk's settings without a default: a config.json without them describes no model.
REQUIRED_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(transformer.TransformerConfig)
                            if f.default is dataclasses.MISSING)
# base.json names the base workdir relative to the heads workdir when it is at most this many
# directories up (siblings, cousins: moved or copied together), else by its absolute path.
MAX_RELATIVE_BASE_LEVELS = 2


def write_base_reference(workdir: str | os.PathLike, base: str | os.PathLike) -> None:
  """Records that the checkpoints hold heads only, on the trunk of workdir `base`.

  `base_workdir` is relative to `workdir` when the two are near each other (so that copying
  both elsewhere keeps the pair), else absolute; `base_workdir_absolute` is the fallback for a
  heads workdir moved alone. Either on an object store (a URL): absolute only.
  """
  if jax.process_index() != 0:
    return
  workdir, base = paths.as_path(workdir), paths.as_path(base)
  near = False
  if not paths.is_url(workdir) and not paths.is_url(base):
    relative = os.path.relpath(base, workdir)
    near = pathlib.PurePath(relative).parts.count('..') <= MAX_RELATIVE_BASE_LEVELS
  write_json_atomically(workdir / BASE_FILENAME,
                        {'base_workdir': relative if near else str(base),
                         'base_workdir_absolute': str(base), 'checkpoints_hold': 'heads'})


def base_reference(workdir: str | os.PathLike) -> epath.Path | None:
  """The base workdir holding the trunk, if the checkpoints hold heads only.

  `base_workdir` is absolute, or relative to `workdir`; `base_workdir_absolute`, if there, is
  tried when it is not an mtp workdir.
  """
  workdir = paths.as_path(workdir)
  path = workdir / BASE_FILENAME
  if not path.exists():
    return None
  try:
    record = json.loads(path.read_text())
    named = record['base_workdir']
    candidates = [paths.as_path(named) if paths.is_url(named) or paths.is_url(workdir)
                  else paths.as_path(os.path.normpath(workdir / named))]
    if record.get('base_workdir_absolute'):
      candidates.append(paths.as_path(record['base_workdir_absolute']))
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(f'{path} is unreadable ({type(e).__name__}: {e}).') from e
  for base in candidates:
    if (base / CONFIG_FILENAME).exists():
      return base
  tried = ' nor '.join(str(c) for c in dict.fromkeys(candidates))
  raise CheckpointError(
      f'{workdir} holds heads on the trunk of another workdir, but {tried} is not an mtp workdir '
      f'(moved or deleted?). Point at it: set "base_workdir" in {path} to its path, absolute or '
      f'relative to {workdir}.')


class _Manager(ocp.CheckpointManager):
  """Orbax's manager, which leaves JAX's preemption sync point to the training loop
  (mtp/train/preemption.py). Orbax would ask it too, with the step it saves, in `save` and
  again from its finalize thread while the loop has moved on: that sets a process's call counter
  off the loop's, and the processes could disagree on the step to stop at."""

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


class Checkpointer:
  """Saves and restores train state plus data iterator under `workdir/checkpoints`."""

  def __init__(self, workdir: str | os.PathLike, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = paths.as_path(workdir) / CHECKPOINT_DIRNAME
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=not read_only,
        read_only=read_only)
    self._manager = _Manager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params, opt_state, data_iterator=None, force: bool = False) -> bool:
    """Starts saving (asynchronously); the data iterator's state is captured now."""
    items = dict(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                 fingerprints=_fingerprints_args(params=params, opt_state=opt_state))
    if data_iterator is not None:
      items[_DATA_POSITION] = _pipeline().iterator_checkpoint_args(data_iterator)
    return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

  def save_params(self, step: int, params) -> bool:
    """Saves parameters alone (an imported model has no optimizer state or data position);
    `restore` without an optimizer state reads them."""
    return self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), fingerprints=_fingerprints_args(params=params)),
        force=True)

  def restore(self, step: int, params=None, opt_state=None, data_iterator=None):
    """Restores the given items at `step` into the shapes and shardings of the abstract trees.

    `params` and `opt_state` are abstract trees (`abstract_with_shardings`). Either may name only
    part of what was saved: the rest is not read. A tree saved under the heads' legacy parameter
    names is read into today's (see `_SavedTree`).

    Returns (params or None, opt_state or None); `data_iterator` is restored in place.
    """
    path = self.directory / str(step)
    try:
      trees = {name: _SavedTree(path / name, target) for name, target in
               (('params', params), ('opt_state', opt_state)) if target is not None}
      items = {name: ocp.args.StandardRestore(tree.item) for name, tree in trees.items()}
      if data_iterator is not None and (path / _DATA_POSITION).exists():
        items[_DATA_POSITION] = _pipeline().iterator_checkpoint_args(data_iterator, restore=True)
      if (path / _FINGERPRINTS).exists():  # Checkpoints written before fingerprints have none.
        items[_FINGERPRINTS] = ocp.args.JsonRestore()
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except (CheckpointError, layout.LayoutMismatchError):
      raise
    except Exception as e:  # Orbax raises many types for unreadable files.
      logging.debug('Restoring checkpoint %s failed: %s', path, e)  # --verbosity=1
      raise UnreadableCheckpointError(path, _brief(e), self._older(step)) from e
    saved = restored.get(_FINGERPRINTS) if _FINGERPRINTS in items else None
    for name in trees:
      bad = fingerprint.mismatches(restored[name], saved.get(name, {})) if saved else []
      if bad:
        raise UnreadableCheckpointError(
            path, f'{name}: {len(bad)} arrays read back other values than were saved, such as '
            f'{bad[0]}: their fingerprints differ', self._older(step))
    if data_iterator is not None:
      data_iterator.set_state(_data_position(path, restored.get(_DATA_POSITION)))
    out = {name: tree.unpack(restored[name]) for name, tree in trees.items()}
    return out.get('params'), out.get('opt_state')

  def _older(self, step: int) -> int | None:
    """The newest step before `step`, if any."""
    return max((s for s in self.all_steps() if s < step), default=None)

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


# The checkpoint item holding `fingerprint.fingerprints` of the saved trees.
_FINGERPRINTS = 'fingerprints'
# The item holding the data position (global batches consumed, written by process 0): any
# process count restores it. Checkpoints written before it hold `data/process_{i}-of-{n}.json`
# (grain's handler), which count the same batches.
_DATA_POSITION = 'data_position'
_LEGACY_DATA = 'data'


def _data_position(path: pathlib.Path, saved) -> dict[str, int]:
  """The data iterator state saved in checkpoint `path` (`saved`: its data_position item)."""
  pipeline = _pipeline()
  try:
    if saved is not None:
      return {pipeline.POSITION_KEY: pipeline.position_from_state(saved)}
    if (path / _LEGACY_DATA).is_dir():
      return {pipeline.POSITION_KEY: pipeline.read_legacy_position(path / _LEGACY_DATA)}
  except ValueError as e:
    raise CheckpointError(f'Checkpoint {path}: unreadable data position ({e}).') from e
  raise CheckpointError(f'Checkpoint {path} holds no data position ({_DATA_POSITION}/): it '
                        'cannot resume training (it holds parameters only?).')


def _pipeline():
  """`mtp.data.pipeline`, imported where training saves or restores a data position: it
  imports grain, which decoding (`mtp.load`) does without (the GPU machines' image lacks it)."""
  from mtp.data import pipeline  # pylint: disable=import-outside-toplevel
  return pipeline


def _fingerprints_args(**trees) -> ocp.args.JsonSave:
  return ocp.args.JsonSave({name: fingerprint.fingerprints(tree) for name, tree in trees.items()})


def abstract_with_shardings(tree, shardings):
  """ShapeDtypeStructs carrying shardings, as Orbax wants for a sharded restore."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def restore_params(workdir: str | os.PathLike, target: nnx.State, *, step: int | None = None,
                   parts: Sequence[str] | None = None,
                   convert_layout: bool = True) -> tuple[nnx.State, int]:
  """Restores the parameters of a workdir's checkpoint: the one place that reads them.

  A workdir that holds heads only (`base.json`) gives its heads; the trunk comes from the latest
  checkpoint of the base workdir it names.

  Args:
    workdir: a training (or imported) workdir.
    target: abstract parameters of the model to restore into, carrying the shardings to place
      them with (`abstract_with_shardings`).
    step: the checkpoint; default the latest.
    parts: the top-level parts of `target` to restore ('trunk', 'heads'); default all. The
      checkpoint may hold other parts (another model's heads, say).
    convert_layout: a trunk saved in the other layer layout (scanned or unrolled,
      `mtp.model.layout`) is converted into `target`'s; False raises
      `layout.LayoutMismatchError` instead.

  Returns:
    (the parameters: `target`'s `parts`, restored; the step).

  Raises:
    CheckpointError: no such checkpoint, or it does not hold these parameters (the message names
      the workdir and what is missing).
  """
  workdir = paths.as_path(workdir)
  parts = tuple(parts or target.keys())
  base = base_reference(workdir)
  here = [p for p in parts if base is None or p != param_tree.TRUNK]
  step, restored = _restore_parts(workdir, target, step, here, convert_layout)
  if base is not None and param_tree.TRUNK in parts:
    _, trunk = _restore_parts(base, target, None, [param_tree.TRUNK], convert_layout)
    restored = {**restored, **trunk}
  wanted = param_tree.select(target, parts)
  return jax.tree.unflatten(jax.tree.structure(wanted),
                            [restored[path] for path in _flat(wanted)]), step


def _restore_parts(workdir: pathlib.Path, target: nnx.State, step: int | None,
                   parts: Sequence[str], convert_layout: bool = True) -> tuple[int, dict]:
  """(step, {path: array}) of `parts` at `step` (default the latest) of `workdir`, the trunk's
  layers in `target`'s layout.

  Without a step, a latest checkpoint that does not read back gives way to the newest that
  does, with a warning naming both; when none does, the error names the latest."""
  checkpointer = Checkpointer(workdir, read_only=True)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise CheckpointError(f'{checkpointer.directory} holds no checkpoint.')
    if step is not None and step not in steps:
      raise CheckpointError(f'{checkpointer.directory} has no step {step}; it has {steps}.')
    if not parts:
      return max(steps) if step is None else step, {}
    wanted = param_tree.select(target, parts)
    if step is not None:
      return step, _restore_step(checkpointer, workdir, step, wanted, convert_layout)
    newest = None
    for candidate in sorted(steps, reverse=True):
      try:
        restored = _restore_step(checkpointer, workdir, candidate, wanted, convert_layout)
      except UnreadableCheckpointError as e:
        newest = newest or e
        continue
      if newest is not None:
        logging.warning('Checkpoint %s could not be restored (%s): restored step %d, the newest '
                        'checkpoint that restores, instead (the other was left untouched).',
                        newest.path, newest.reason, candidate)
      return candidate, restored
    if len(steps) == 1:
      raise newest
    raise CheckpointError(
        f'Checkpoint {newest.path} could not be restored ({newest.reason}), nor could any '
        f'earlier one (steps {sorted(steps)[:-1]}); they were left untouched (--verbosity=1 '
        'logs the details).') from newest
  finally:
    checkpointer.close()


def _restore_step(checkpointer: Checkpointer, workdir: pathlib.Path, step: int, wanted,
                  convert_layout: bool) -> dict:
  """{path: array} of `wanted` at `step`, the trunk's layers in `wanted`'s layout."""
  saved_layout = _saved_layout(checkpointer.directory / str(step) / 'params')
  wanted_layout = layout.tree_layout(layout.nest(_flat(wanted)))
  if saved_layout is None or wanted_layout is None or saved_layout == wanted_layout:
    params, _ = checkpointer.restore(step, wanted)
    return _flat(params)
  if not convert_layout:
    raise layout.LayoutMismatchError(layout.mismatch_message(
        f'The checkpoint {checkpointer.directory / str(step)}', saved_layout, wanted_layout,
        workdir))
  return _restore_converted(checkpointer, step, wanted, wanted_layout)


def _saved_layout(directory: pathlib.Path) -> str | None:
  """The layer layout of a saved parameter tree (None when it holds no trunk, or when its
  metadata is unreadable: the restore then names the damage)."""
  handler = ocp.StandardCheckpointHandler()
  try:
    metadata = handler.metadata(directory).tree
  except Exception:  # pylint: disable=broad-except  # Orbax raises many types.
    return None
  finally:
    handler.close()
  return layout.tree_layout(layout.nest(_flat(metadata)))


def _restore_converted(checkpointer: Checkpointer, step: int, wanted, wanted_layout: str
                       ) -> dict:
  """{path: array} of `wanted`, read from a checkpoint in the other layer layout and
  converted (stacked or unstacked), each array placed with `wanted`'s sharding."""
  to_scanned = wanted_layout == layout.SCANNED
  wanted_flat = _flat(wanted)
  saved_form = layout.to_layout(layout.nest(wanted_flat), not to_scanned, layer_key=str)
  params, _ = checkpointer.restore(step, saved_form)
  converted = layout.flatten(layout.to_layout(layout.nest(_flat(params)), to_scanned,
                                              layer_key=str))
  return {path: jax.device_put(converted[path], leaf.sharding)
          for path, leaf in wanted_flat.items()}


def _flat(tree) -> dict[tuple[str, ...], Any]:
  """{path: leaf}, the path's keys as strings, as Orbax names the arrays it saves."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {fingerprint.path_keys(path): leaf for path, leaf in flat}


class _SavedTree:
  """Reads one saved tree (an Orbax item) into an abstract target tree.

  The restore item is the saved tree's own structure, from its metadata: the arrays the target
  wants carry its dtypes and shardings.
  The target's paths are the saved ones, or, for a tree saved before the head families' child
  lists were renamed, those that `upgrade_legacy_tree` gives the saved ones.
  """

  def __init__(self, directory: epath.Path, target):
    handler = ocp.StandardCheckpointHandler()
    try:
      metadata = handler.metadata(directory).tree
    finally:
      handler.close()
    saved, wanted = _flat(metadata), _flat(target)
    saved_layout = layout.tree_layout(layout.nest(saved))
    wanted_layout = layout.tree_layout(layout.nest(wanted))
    if saved_layout and wanted_layout and saved_layout != wanted_layout:
      raise layout.LayoutMismatchError(layout.mismatch_message(
          f'The checkpoint {directory}', saved_layout, wanted_layout,
          directory.parents[2]))  # <workdir>/checkpoints/<step>/<item>
    if wanted.keys() <= saved.keys():
      sources = {path: path for path in wanted}
    else:
      sources = _legacy_sources(directory, saved, wanted)
    for path, source in sources.items():
      if tuple(saved[source].shape) != tuple(wanted[path].shape):
        raise CheckpointError(
            f'{directory}: {"/".join(source)} has shape {tuple(saved[source].shape)}, the model '
            f'wants {tuple(wanted[path].shape)}: the checkpoint is of another model.')
    by_source = {sources[path]: leaf for path, leaf in wanted.items()}
    # StandardRestore takes no placeholders: what the target does not want (another model's
    # heads, say: small) is read onto one local device and dropped.
    aside = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def item(path, leaf):
      want = by_source.get(fingerprint.path_keys(path))
      if want is None:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=aside)
      return jax.ShapeDtypeStruct(leaf.shape, want.dtype, sharding=want.sharding)
    self.item = jax.tree_util.tree_map_with_path(item, metadata)
    self._treedef = jax.tree.structure(target)
    self._sources = [sources[path] for path in wanted]

  def unpack(self, restored):
    arrays = _flat(restored)
    return jax.tree.unflatten(self._treedef, [arrays[source] for source in self._sources])


def _legacy_sources(directory: epath.Path, saved: dict, wanted: dict) -> dict:
  """{target path: saved path} for a tree saved under the heads' legacy parameter names."""
  # The saved paths as leaves of a nested dict (lists too, as dicts of indices), renamed
  # wherever a `heads` node has the old layout (in the parameters and in the optimizer state).
  nested: dict = {}
  for path in saved:
    node = nested
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = _SavedPath(path)
  upgraded = _flat(heads_lib.upgrade_legacy_tree(nested))
  renamed = {path: leaf.path for path, leaf in upgraded.items()}
  missing = [path for path in wanted if path not in renamed]
  if missing and all(p[0] == param_tree.TRUNK for p in missing) and not any(
      p[0] == param_tree.TRUNK for p in saved):
    workdir = directory.parents[2]  # <workdir>/checkpoints/<step>/<item>
    raise CheckpointError(
        f'{directory} holds heads only, and {workdir / BASE_FILENAME}, which names the workdir '
        'holding their trunk, is missing: restore it as {"base_workdir": "<that workdir>", '
        '"checkpoints_hold": "heads"}.')
  if missing:
    raise CheckpointError(
        f'{directory} does not hold {len(missing)} of the arrays the model wants, such as '
        f'{", ".join("/".join(p) for p in missing[:3])}: the checkpoint is of another model.')
  return {path: renamed[path] for path in wanted}


class _SavedPath:
  """A leaf that `upgrade_legacy_tree` carries along unchanged (not a dict, list or array)."""

  def __init__(self, path: tuple[str, ...]):
    self.path = path
