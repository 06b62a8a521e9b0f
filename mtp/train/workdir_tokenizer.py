"""The tokenizer of a training workdir: built once (process 0 first), or adopted from the workdir
that `init_from` names (or a prepared dataset's directory). Read and written through
`etils.epath`: the workdir may be on an object store."""

from __future__ import annotations

import os

import jax
import ml_collections

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib


def prepare(config: ml_collections.ConfigDict, workdir: str | os.PathLike
            ) -> tokenizer_lib.Tokenizer:
  """The workdir's tokenizer, built from the corpus by process 0 if it has none yet."""
  if jax.process_index() == 0:
    tokenizer = _load_or_build(config, workdir)
  sync('tokenizer')
  if jax.process_index() != 0:
    tokenizer = _load_or_build(config, workdir)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f'The tokenizer in {workdir} has {tokenizer.vocab_size} ids but '
                     f'model.vocab_size is {config.model.vocab_size}: the vocabulary does not '
                     'match this workdir.')
  return tokenizer


def _load_or_build(config: ml_collections.ConfigDict, workdir: str | os.PathLike
                   ) -> tokenizer_lib.Tokenizer:
  """`workdir/tokenizer.json` if present, else one built from the corpus and saved there."""
  workdir = paths.as_path(workdir)
  if (workdir / tokenizer_lib.FILENAME).exists():
    return tokenizer_lib.Tokenizer.load(workdir)
  tokenizer = pipeline.build_tokenizer(config.data, config.model.vocab_size)
  tokenizer.save(workdir)
  return tokenizer


def adopt(source: str | os.PathLike, workdir: str | os.PathLike) -> None:
  """A workdir initialised from another one starts with that workdir's tokenizer (and its
  special ids, for an imported pretrained model)."""
  source, workdir = paths.as_path(source), paths.as_path(workdir)
  target = workdir / tokenizer_lib.FILENAME
  if jax.process_index() == 0 and not target.exists():
    if not (source / tokenizer_lib.FILENAME).exists():
      raise checkpointing.CheckpointError(f'init_from: {source / tokenizer_lib.FILENAME} does '
                                          'not exist.')
    specials = source / tokenizer_lib.SPECIAL_IDS_FILENAME
    if specials.exists():  # First: whoever sees tokenizer.json sees its special ids too.
      specials.copy(workdir / tokenizer_lib.SPECIAL_IDS_FILENAME, overwrite=True)
    (source / tokenizer_lib.FILENAME).copy(target, overwrite=True)
  sync('adopt-tokenizer')


def sync(name: str) -> None:
  """All processes wait here for each other (multi-host only)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
