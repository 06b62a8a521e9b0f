"""Pretrained Llama weights -> an mtp workdir that `mtp.load`, `launch.generate` and training with
`init_from` accept.

The workdir holds `config.json` (configs/base.py with `model.*` from the weights, heads only where
a Hugging Face directory carries them in a format of `mtp.export.hf`, and a `pretrained` record
of the source: path, format, name, and each file's size and sha256), `tokenizer.json` with
`special_tokens.json` (and `chat_template.jinja` when the model has a chat template), and an
Orbax checkpoint at step 0 holding the parameters only. Everything is read and checked before
anything is written; the workdir is then built in a temporary sibling directory and renamed into
place, so a failed import leaves nothing behind and an existing workdir is never touched.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
from typing import Any

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


def resolve_source(source: str | os.PathLike) -> pathlib.Path:
  """A path as given, or the cached file behind an alias ('smollm2', fetched if needed)."""
  path = paths.local_path(source, '--source')  # Local only: a URL is refused by name.
  if str(source) == smollm2.ALIAS and not path.exists():
    return smollm2.fetch_gguf()
  return path


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


def check_target(workdir: pathlib.Path) -> None:
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


def import_weights(source: str | os.PathLike, workdir: str | os.PathLike) -> pathlib.Path:
  """Writes a workdir from a GGUF file, a Hugging Face directory or an alias ('smollm2').

  Returns:
    The workdir's path.

  Raises:
    PretrainedError: unreadable or unsupported weights, or an existing non-empty workdir;
      nothing is written then.
    workdir_lock.WorkdirLockedError: another process trains or imports into `workdir`.
  """
  # Local files only, for now: a URL is refused by name, never folded into a local path.
  paths.local_path(source, '--source')
  workdir = paths.local_path(workdir, '--workdir').absolute()
  check_target(workdir)
  checkpoint = read_source(resolve_source(source))
  config = make_config(checkpoint)
  params = make_params(checkpoint, config)
  checkpoint.tensors = {}  # The parameters hold the weights now.

  workdir.parent.mkdir(parents=True, exist_ok=True)
  with workdir_lock.WorkdirLock(workdir):  # No trainer nor other import writes there meanwhile.
    _write(workdir, config, checkpoint.tokenizer, params)
  return workdir


def _write(workdir: pathlib.Path, config: ml_collections.ConfigDict, tokenizer,
           params: nnx.State) -> None:
  """Builds the workdir in a staging sibling and renames it into place."""
  staging = workdir.with_name(f'.{workdir.name}.importing-{os.getpid()}')
  shutil.rmtree(staging, ignore_errors=True)
  try:
    staging.mkdir()
    checkpointing.save_config(staging, config)
    tokenizer.save(staging)
    checkpointer = checkpointing.Checkpointer(staging, max_to_keep=1, async_save=False)
    try:
      checkpointer.save_params(0, params)
    finally:
      checkpointer.close()
    check_target(workdir)  # Still free? An empty directory is replaced.
    if workdir.exists():
      workdir.rmdir()
    os.rename(staging, workdir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
