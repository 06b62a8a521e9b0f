"""The export driver: checks, loads the workdir once, writes a format into a staging directory.

`export(workdir, format, output)` checks everything it can before any work (the format, the
dtype, the format's options, the workdir and its checkpoint, the output path), then loads the
model (`mtp.load`: a heads-on-a-frozen-base workdir comes back merged, trunk and heads) and
hands it to the format's `write(loaded, directory, dtype, **options) -> dict`, which fills an
empty local directory. For a local `output` that directory is a temporary sibling
(`.NAME.exporting-PID`), renamed to `output` only when complete and holding its `export.json`;
any failure removes it, so `output` is either whole or absent (a killed export's staging
directory is removed by the next export to the same output). Every file of an export gets the
mode an ordinary new file gets (0666 less the umask: 0644 as a rule), weights included,
whatever their writer chose.

Either path may be a URL (`gs://bucket/run`): the workdir is read as `mtp.load` reads one.
The formats' writers (Orbax, safetensors, jax.export) write local files, and an object store
has no rename, so an export to a URL is staged in a local directory of this host (under
`paths.staging_parent`) and then uploaded file by file, `export.json` last: an
export on the bucket without one is incomplete (a failed upload removes what it wrote; one
killed mid-upload leaves the partial directory, which the next export to it names).

The lock taken is the output's (`<output>.lock`, `checkpoint/workdir_lock.py`): the export
writes there, and two exports to one output would race between their checks and the rename.
The source workdir is only read (Orbax checkpoints are complete once listed), so a model can
be exported while it trains.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import pathlib
import shutil
import time
from typing import Any

from absl import logging
from etils import epath
import numpy as np

from mtp.checkpoint import paths
from mtp.export import ExportError
from mtp.export import manifest as manifest_lib


@dataclasses.dataclass(frozen=True)
class Format:
  """An export format.

  Attributes:
    name: what `--format` takes.
    module: the module whose `write(loaded, directory, dtype, **options) -> dict` writes it.
    dtypes: the parameter dtypes it can hold (the first is the default).
    options: the keyword options its `write` takes beyond those.
    summary: one line for help texts.
  """
  name: str
  module: str
  dtypes: tuple[str, ...]
  options: tuple[str, ...]
  summary: str


_REGISTRY = (
    Format('params', 'mtp.export.params', ('float32', 'bfloat16'), (),
           'a param-only Orbax checkpoint, config.json and the tokenizer (mtp.load reads it)'),
    Format('hf', 'mtp.export.hf', ('float32', 'bfloat16', 'float16'), ('max_shard_bytes',),
           'a Hugging Face Llama directory, heads in their serving systems\' formats'),
    Format('jax_export', 'mtp.export.jax_artifact', ('float32', 'bfloat16'),
           ('max_new_tokens', 'tree', 'lookup', 'temperature', 'top_k', 'top_p', 'platforms'),
           'the whole generate function serialized with jax.export, parameters beside it'),
)
FORMATS: dict[str, Format] = {f.name: f for f in _REGISTRY}
NAMES: tuple[str, ...] = tuple(FORMATS)


def get_format(name: str) -> Format:
  """The format called `name`; ExportError listing the formats otherwise."""
  try:
    return FORMATS[name]
  except (KeyError, TypeError):
    raise ExportError(f'unknown export format {name!r}: use one of {", ".join(NAMES)}'
                      ) from None


def export(workdir: str | os.PathLike, format: str, output: str | os.PathLike, *,  # noqa: A002
           dtype: str | None = None, **options) -> dict[str, Any]:
  """Exports the latest checkpoint of `workdir` to the new directory `output`.

  Args:
    workdir: a training or imported workdir (heads on a frozen base included), local or a
      URL (`gs://bucket/run`).
    format: a name in `NAMES`.
    output: the directory to create, local or a URL; it must not exist.
    dtype: the parameters' dtype in the export (None: float32).
    **options: the format's own options (`Format.options`), such as jax_export's
      max_new_tokens.

  Returns:
    A summary: format, output, dtype, step, bytes, seconds (load, write, total) and the
    format's own figures. The same, with the source, is the export's `export.json`.

  Raises:
    ExportError: an unknown format, an unsupported dtype or option, a workdir without a
      checkpoint, an existing output; nothing is written then.
    checkpointing.CheckpointError: the checkpoint is unreadable (the message names it).
    workdir_lock.WorkdirLockedError: another export writes `output`.
  """
  start = time.perf_counter()
  fmt = get_format(format)
  np_dtype = _checked_dtype(fmt, dtype)
  workdir, output = _path(workdir, '--workdir'), _path(output, '--output')
  remote = paths.is_url(output)
  module = _module(fmt)
  unknown = sorted(set(options) - set(fmt.options))
  if unknown:
    raise ExportError(f'option {", ".join(unknown)} does not apply to --format={fmt.name}'
                      + (f' (it takes {", ".join(fmt.options)})' if fmt.options else ''))
  step = check_workdir(workdir)
  _check_output(output)
  if hasattr(module, 'check_options'):  # Before the model loads: bad options fail at once.
    module.check_options(workdir, np_dtype, **options)

  from mtp.checkpoint import loading  # pylint: disable=import-outside-toplevel  # JAX starts here.
  from mtp.checkpoint import workdir_lock  # pylint: disable=import-outside-toplevel
  if not remote:  # An object store has no directories to make.
    output.parent.mkdir(parents=True, exist_ok=True)
  with workdir_lock.WorkdirLock(output):
    _check_output(output)  # Still free now that it is ours.
    # Every format holds per-layer weights, as serving reads them (MaxText unstacks its scanned
    # checkpoints the same way): a scanned trunk loads unstacked.
    loaded = loading.load(workdir, step=step, scan_layers=False)
    loaded_at = time.perf_counter()
    staging_parent = paths.staging_parent(output)
    # Staging directories of exports to this output that were killed: stale, as the lock is ours.
    for stale in staging_parent.glob(f'.{output.name}.exporting-*'):
      shutil.rmtree(stale, ignore_errors=True)
    staging = staging_parent / f'.{output.name}.exporting-{os.getpid()}'
    uploading = False
    try:
      staging.mkdir(parents=remote)
      details = module.write(loaded, staging, np_dtype, **options) or {}
      _ordinary_modes(staging)
      written_at = time.perf_counter()
      summary = {
          'format': fmt.name, 'output': str(output), 'dtype': np_dtype.name,
          'step': int(loaded.step), 'bytes': manifest_lib.directory_bytes(staging),
          'seconds': {'load': round(loaded_at - start, 3),
                      'write': round(written_at - loaded_at, 3),
                      'total': round(written_at - start, 3)},
          fmt.name: details}
      manifest_lib.write(staging, {**summary, **_provenance(workdir, loaded.step)})
      _check_output(output)
      if remote:
        uploading = True  # From here on, what is at `output` is this export's.
        paths.upload_tree(staging, output, last=(manifest_lib.FILENAME,))
        uploading = False  # Complete: nothing below may remove it.
        shutil.rmtree(staging, ignore_errors=True)
      else:
        os.rename(staging, output)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      if uploading:
        _remove_partial(output)
      raise
  return summary


def _path(path: str | os.PathLike, what: str) -> pathlib.Path | epath.Path:
  """A local path as an absolute pathlib.Path (pathlib would fold `gs://b/x` into `gs:/b/x`),
  a URL as an epath.Path; a scheme nothing serves is named (`paths.path_or_url`)."""
  try:
    checked = paths.path_or_url(path, what)
  except ValueError as e:
    raise ExportError(str(e)) from None
  return checked if paths.is_url(checked) else pathlib.Path(checked)


def _remove_partial(output: epath.Path) -> None:
  """Removes what a failed upload wrote at `output` (it has no export.json yet). Best effort:
  the error that stopped the upload (the network, as a rule) may stop this too, and is the one
  to report; what stays behind lacks export.json, so it is no complete export."""
  try:
    paths.remove_tree(output)
  except Exception:  # pylint: disable=broad-except
    logging.warning('could not remove the partial export at %s: remove it by hand', output,
                    exc_info=True)


def _checked_dtype(fmt: Format, dtype: str | None) -> np.dtype:
  name = fmt.dtypes[0] if dtype is None else dtype
  if name not in fmt.dtypes:
    raise ExportError(f'--format={fmt.name} cannot hold dtype {dtype!r}: use one of '
                      f'{", ".join(fmt.dtypes)}')
  import ml_dtypes  # pylint: disable=import-outside-toplevel  # numpy has no bfloat16.
  return np.dtype(ml_dtypes.bfloat16) if name == 'bfloat16' else np.dtype(name)


def _module(fmt: Format):
  """The format's writer module, imported only when asked for (hf's may not exist yet)."""
  try:
    return importlib.import_module(fmt.module)
  except ModuleNotFoundError as e:
    if e.name != fmt.module:
      raise
    raise ExportError(f'--format={fmt.name} is not available in this version of mtp '
                      f'({fmt.module} is missing)') from None


def check_workdir(workdir: pathlib.Path | epath.Path) -> int:
  """The latest checkpoint step of a workdir that can be exported; ExportError otherwise."""
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  if not workdir.is_dir():
    raise ExportError(f'workdir {workdir} does not exist')
  record = manifest_lib.read(workdir)
  if record is not None and record['format'] != 'params':
    raise ExportError(f'{workdir} is a {record["format"]} export, not a workdir: export from '
                      f'the workdir it came from ({record.get("source", {}).get("workdir")})')
  if not (workdir / checkpointing.CONFIG_FILENAME).is_file():
    raise ExportError(f'{workdir} is not an mtp workdir: it has no '
                      f'{checkpointing.CONFIG_FILENAME}')
  step = _latest_step(workdir)
  try:
    base = checkpointing.base_reference(workdir)
  except checkpointing.CheckpointError as e:
    raise ExportError(str(e)) from None
  if base is not None:
    _latest_step(base)  # Its trunk: named now rather than after loading the heads.
  return step


def _latest_step(workdir: pathlib.Path | epath.Path) -> int:
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  checkpointer = checkpointing.Checkpointer(workdir, read_only=True)
  try:
    steps = checkpointer.all_steps()
  finally:
    checkpointer.close()
  if not steps:
    raise ExportError(f'{workdir} holds no checkpoint to export (nothing under '
                      f'{workdir / checkpointing.CHECKPOINT_DIRNAME}): train it first')
  return max(steps)


def _ordinary_modes(directory: pathlib.Path) -> None:
  """Gives every file under `directory` the mode of an ordinary new file, 0666 less the umask:
  safetensors writes its files 0600 (through a private temporary file)."""
  umask = os.umask(0)  # Read back at once: the only portable way to learn it.
  os.umask(umask)
  for path in directory.rglob('*'):
    if path.is_file() and not path.is_symlink():
      path.chmod(0o666 & ~umask)


def _check_output(output: pathlib.Path | epath.Path) -> None:
  if paths.is_url(output):  # No directories on an object store: nothing can be in the way.
    if output.exists():
      partial = '' if manifest_lib.read(output) else (
          f' (without {manifest_lib.FILENAME}: an export stopped while uploading?)')
      raise ExportError(f'output {output} already exists{partial}: exports never write over '
                        'anything; remove it or choose another --output')
    return
  parent = output.parent
  while not parent.exists() and parent != parent.parent:
    parent = parent.parent
  if not parent.is_dir():  # exists() is False below a file; mkdir would say "File exists".
    raise ExportError(f'cannot create output {output}: {parent} is a file, not a directory')
  if output.exists() or output.is_symlink():
    kind = 'directory' if output.is_dir() else 'file'
    raise ExportError(f'output {output} already exists (a {kind}): exports never write over '
                      'anything; remove it or choose another --output')


def _provenance(workdir: pathlib.Path | epath.Path, step: int) -> dict[str, Any]:
  import jax  # pylint: disable=import-outside-toplevel
  import mtp  # pylint: disable=import-outside-toplevel
  return {'source': {'workdir': str(workdir), 'step': int(step)},  # Absolute, or a URL.
          'created': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'jax_version': jax.__version__, 'mtp_version': mtp.__version__}
