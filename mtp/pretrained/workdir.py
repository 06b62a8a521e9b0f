"""Pretrained Llama weights -> an mtp workdir that `mtp.load`, `launch.generate` and training with
`init_from` accept.

The workdir holds `config.json` (configs/base.py with `model.*` from the weights, heads only where
a Hugging Face directory carries them in a format of `mtp.export.hf`, and a `pretrained` record
of the source: path, format, name, and each file's size and sha256), `tokenizer.json` with
`special_tokens.json` (and `chat_template.jinja` when the model has a chat template), and an
Orbax checkpoint at step 0 holding the parameters only. Everything is read and checked before
anything is written; the workdir is then built in a temporary sibling directory and renamed into
place, so a failed import leaves nothing behind and an existing workdir is never touched.

Source and workdir may be URLs (`gs://bucket/...`). The readers take local files (memory maps,
the tokenizers library), so a source on an object store is read from local copies
(`paths.local_copy`: fetched once per host, again only when the object changes): a GGUF file,
or a Hugging Face directory's JSON, Jinja and safetensors files (what `hf_directory` reads;
PyTorch `.bin` weights and the like are not fetched). An object store has no rename: a workdir
there is written in place, the checkpoint first (Orbax writes it there itself), then the
tokenizer, and `config.json`, which makes it an mtp workdir, last; a failed import removes what
it wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import hashlib
import os
import pathlib
import shutil
import tempfile
from typing import Any

from absl import logging
from etils import epath
import jax
import ml_collections
import numpy as np
from flax import nnx

from configs import base
from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.checkpoint import workdir_lock
from mtp.model import mtp_model
from mtp.pretrained import gguf_file
from mtp.pretrained import hf_directory
from mtp.pretrained import llama
from mtp.pretrained import smollm2
from mtp.pretrained.llama import PretrainedError

GGUF_MAGIC = b'GGUF'


# The files of a Hugging Face directory on an object store that an import fetches: those
# `hf_directory` reads (config, tokenizer, index and generation JSON, chat template, weights).
_HF_SUFFIXES = ('.json', '.jinja', '.safetensors')


def resolve_source(source: str | os.PathLike) -> pathlib.Path | epath.Path:
  """A path as given (a URL as an epath.Path, never folded into a local path), or the cached
  file behind an alias ('smollm2', fetched if needed)."""
  if paths.is_url(source):
    return _url(source, '--source')
  path = pathlib.Path(source)
  if str(source) == smollm2.ALIAS and not path.exists():
    return smollm2.fetch_gguf()
  return path


def _url(path: str | os.PathLike, what: str) -> epath.Path:
  """A URL a component here can read and write (`paths.path_or_url`), else PretrainedError."""
  try:
    return paths.path_or_url(path, what)
  except ValueError as e:
    raise PretrainedError(str(e)) from None


@contextlib.contextmanager
def local_source(source: str | os.PathLike) -> Iterator[pathlib.Path]:
  """`source` as a local path, for readers of local files only.

  A local path is itself. A file at a URL (GGUF) is its local copy (`paths.local_copy`). A
  Hugging Face directory at a URL is a temporary local directory of the same name, under
  `paths.host_cache_root()/importing/`, of links to local copies of its `_HF_SUFFIXES` files:
  exactly the files there now (a cached copy of a file since removed there is not seen),
  removed on exit.

  Raises:
    PretrainedError: nothing is at the URL.
  """
  if not paths.is_url(source):
    yield pathlib.Path(source)
    return
  remote = epath.Path(source)
  if remote.is_file():
    yield paths.local_copy(remote)
    return
  if not remote.is_dir():
    raise PretrainedError(f'{source} does not exist: give a .gguf file or a Hugging Face model '
                          'directory.')
  parent = paths.host_cache_root() / 'importing'
  parent.mkdir(parents=True, exist_ok=True)
  root = pathlib.Path(tempfile.mkdtemp(prefix=f'{os.getpid()}-', dir=parent))
  try:
    local = root / remote.name  # hf_directory names a model without `_name_or_path` after it.
    local.mkdir()
    for file, relative in paths.list_files(remote):
      if file.name.endswith(_HF_SUFFIXES):
        (local / relative).parent.mkdir(parents=True, exist_ok=True)
        (local / relative).symlink_to(paths.local_copy(file))
    yield local
  finally:
    shutil.rmtree(root, ignore_errors=True)


def read_source(path: str | os.PathLike) -> llama.Checkpoint:
  """Reads a GGUF file or a Hugging Face directory (checked, float32, in memory)."""
  path = pathlib.Path(path)
  if path.is_dir():
    return hf_directory.read(path)
  if not path.is_file():
    raise PretrainedError(f'{path} does not exist: give a .gguf file or a Hugging Face model '
                          'directory.')
  with open(path, 'rb') as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise PretrainedError(f'{path} is not a GGUF file (it starts with {magic!r}, not '
                          f'{GGUF_MAGIC!r}); give a .gguf file or a Hugging Face directory.')
  return gguf_file.read(path)


def check_target(workdir: pathlib.Path | epath.Path) -> None:
  if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
    raise PretrainedError(f'{workdir} already exists and is not empty; choose a new --workdir '
                          '(nothing was written).')


def file_digest(path: pathlib.Path) -> dict[str, Any]:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return {'name': path.name, 'size': path.stat().st_size, 'sha256': digest.hexdigest()}


def make_config(checkpoint: llama.Checkpoint) -> ml_collections.ConfigDict:
  """configs/base.py with the trunk's shape, the heads found beside it (if any), and the
  `pretrained` record."""
  config = base.get_config()
  for key, value in checkpoint.shape.model_config().items():
    config.model[key] = value
  if checkpoint.heads is not None:
    family, heads = checkpoint.heads
    config.model.mtp_head_type = family
    config.model.mtp_num_heads = heads.num_heads
    for key, value in heads.options.items():
      config.model[key] = value
    if heads.draft_ids is not None:
      config.mtp_head_draft_vocab = len(heads.draft_ids)
  source = checkpoint.source
  config.pretrained = {
      'format': source['format'], 'path': source['path'], 'name': source.get('name', ''),
      'files': [file_digest(pathlib.Path(f)) for f in source.get('files', [])],
  }
  return config


def make_params(checkpoint: llama.Checkpoint, config: ml_collections.ConfigDict) -> nnx.State:
  """The parameters of `MTPModel(config.model)` holding the checkpoint's weights."""
  model_config = mtp_model.ModelConfig.from_config(config.model)
  abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(model_config, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  values = llama.to_params(checkpoint)
  if checkpoint.heads is not None:
    values['heads'] = checkpoint.heads[1].params
  expected = nnx.to_pure_dict(state)
  want = dict(jax.tree_util.tree_flatten_with_path(
      jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), expected))[0])
  got = dict(jax.tree_util.tree_flatten_with_path(
      jax.tree.map(lambda x: (tuple(x.shape), np.dtype(np.float32)), values))[0])
  if want != got:
    path = next(p for p in [*want, *got] if want.get(p) != got.get(p))
    raise PretrainedError(
        f'the imported weights do not fit the model built from their own hyper-parameters: '
        f'parameter {jax.tree_util.keystr(path)} is {got.get(path, "missing")}, the model '
        f'expects {want.get(path, "none")}.')
  device = jax.devices()[0]
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x: jax.device_put(np.ascontiguousarray(x, np.float32), device), values))
  return state


def keep_first_layers(checkpoint: llama.Checkpoint, num_layers: int) -> None:
  """Cuts `checkpoint`'s trunk to its first `num_layers` layers, in place: a smaller model of
  the same weights, for smoke runs and tests (its outputs are not the full model's)."""
  total = checkpoint.shape.num_layers
  if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not (
      1 <= num_layers <= total):
    raise PretrainedError(f'num_layers must be an integer in [1, {total}] (the source has '
                          f'{total} layers), got {num_layers!r}.')
  if checkpoint.heads is not None:
    raise PretrainedError('num_layers cuts a trunk; this source has multi-token heads beside '
                          'it, which read the layers it would drop.')
  checkpoint.shape = dataclasses.replace(checkpoint.shape, num_layers=num_layers)
  checkpoint.tensors = {name: value for name, value in checkpoint.tensors.items()
                        if (i := llama.layer_index(name)) is None or i < num_layers}


def import_weights(source: str | os.PathLike, workdir: str | os.PathLike, *,
                   num_layers: int | None = None) -> pathlib.Path | epath.Path:
  """Writes a workdir from a GGUF file, a Hugging Face directory or an alias ('smollm2').

  Args:
    source: a local path or a URL (`gs://...`), or an alias.
    workdir: the new workdir, a local path or a URL.
    num_layers: keep only the trunk's first `num_layers` layers (`keep_first_layers`); None
      keeps them all.

  Returns:
    The workdir's path: absolute, or an epath.Path of the URL.

  Raises:
    PretrainedError: unreadable or unsupported weights, or an existing non-empty workdir;
      nothing is written then.
    workdir_lock.WorkdirLockedError: another process trains or imports into `workdir`.
  """
  remote = paths.is_url(workdir)
  workdir = _url(workdir, '--workdir') if remote else pathlib.Path(workdir).absolute()
  check_target(workdir)
  source = resolve_source(source)
  with local_source(source) as local:
    checkpoint = read_source(local)
    if num_layers is not None:
      keep_first_layers(checkpoint, num_layers)
    if paths.is_url(source):  # The record names the source as given, not this host's copy.
      checkpoint.source['path'] = os.fspath(source)
    config = make_config(checkpoint)  # Hashes the (local copies of the) source's files.
    if num_layers is not None:
      config.pretrained.num_layers_kept = num_layers
  params = make_params(checkpoint, config)
  checkpoint.tensors = {}  # The parameters hold the weights now.
  draft_ids = checkpoint.heads[1].draft_ids if checkpoint.heads is not None else None

  if not remote:  # An object store has no directories to make.
    workdir.parent.mkdir(parents=True, exist_ok=True)
  with workdir_lock.WorkdirLock(workdir):  # No trainer nor other import writes there meanwhile.
    if remote:
      _write_in_place(workdir, config, checkpoint.tokenizer, params, draft_ids)
    else:
      _write(workdir, config, checkpoint.tokenizer, params, draft_ids)
  return workdir


def _save(workdir: pathlib.Path | epath.Path, config: ml_collections.ConfigDict, tokenizer,
          params: nnx.State, draft_ids=None) -> None:
  """The checkpoint, the tokenizer, the heads' draft vocabulary (if any) and, last,
  config.json (which makes it an mtp workdir)."""
  checkpointer = checkpointing.Checkpointer(workdir, max_to_keep=1, async_save=False)
  try:
    checkpointer.save_params(0, params)
  finally:
    checkpointer.close()
  tokenizer.save(workdir)
  if draft_ids is not None:
    checkpointing.save_draft_ids(workdir, draft_ids)
  checkpointing.save_config(workdir, config)


def _write(workdir: pathlib.Path, config: ml_collections.ConfigDict, tokenizer,
           params: nnx.State, draft_ids=None) -> None:
  """Builds the workdir in a staging sibling and renames it into place."""
  staging = workdir.with_name(f'.{workdir.name}.importing-{os.getpid()}')
  shutil.rmtree(staging, ignore_errors=True)
  try:
    staging.mkdir()
    _save(staging, config, tokenizer, params, draft_ids)
    check_target(workdir)  # Still free? An empty directory is replaced.
    if workdir.exists():
      workdir.rmdir()
    os.rename(staging, workdir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def _write_in_place(workdir: epath.Path, config: ml_collections.ConfigDict, tokenizer,
                    params: nnx.State, draft_ids=None) -> None:
  """Writes a workdir on an object store where it stands (a rename there would copy every
  object again); a failure removes what was written."""
  check_target(workdir)  # Still free now that the lock is ours: what is there is this import's.
  try:
    _save(workdir, config, tokenizer, params, draft_ids)
  except BaseException:
    try:  # Best effort: the error that stopped the import (the network, as a rule) is the one
      paths.remove_tree(workdir)  # to report; what stays behind has no config.json.
    except Exception:  # pylint: disable=broad-except
      logging.warning('could not remove the partial import at %s: remove it by hand', workdir,
                      exc_info=True)
    raise
