"""`--format=params`: a param-only serving checkpoint that `mtp.load` reads like a workdir.

Layout (a workdir without the training state):
  config.json             the source's config; model.param_dtype is the export's dtype
  tokenizer.json          (+ special_tokens.json, chat_template.jinja when the model has them)
  checkpoints/<step>/     Orbax: params/ (trunk and heads, merged for a heads-on-a-frozen-base
                          workdir) and their fingerprints; no opt_state/, no data/
  head_accuracies.json    the source's cache of measured head accuracies, when it has one
  export.json             what this is (written by `writer.py`)

The parameters are written in the given dtype, and `config.json` says so, so `mtp.load`
restores them in that dtype, onto any device count: Orbax reads arrays into whatever
shardings the restoring process asks for.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.export import manifest as manifest_lib

def cast_params(state: nnx.State, dtype: np.dtype) -> nnx.State:
  """`state` with every floating-point array in `dtype` (integer arrays, if any, kept)."""
  # jnp.issubdtype knows bfloat16 is a float (numpy's does not).
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      state)


def write(loaded, directory: pathlib.Path, dtype: np.dtype) -> dict:
  """Writes `loaded` (a `checkpoint.loading.LoadedModel`) as a params export into the empty
  `directory`.

  Returns:
    bytes of the checkpoint written, and of the source's training checkpoint (parameters,
    optimizer state and data position; for heads on a frozen base, the heads' checkpoint and
    the base's) for comparison.
  """
  config = loaded.config.copy_and_resolve_references()
  with config.unlocked():
    config.model.param_dtype = dtype.name
    # The trunk is in this checkpoint now: nothing to load from elsewhere.
    config.init_from = ''
  checkpointing.save_config(directory, config)
  loaded.tokenizer.save(directory)
  params = cast_params(nnx.state(loaded.model), dtype)
  checkpointer = checkpointing.Checkpointer(directory, max_to_keep=1, async_save=False)
  try:
    checkpointer.save_params(loaded.step, params)
  finally:
    checkpointer.close()
  checkpoints = directory / checkpointing.CHECKPOINT_DIRNAME
  return {'checkpoint_bytes': manifest_lib.directory_bytes(checkpoints),
          'training_checkpoint_bytes': training_checkpoint_bytes(loaded.workdir, loaded.step)}


def training_checkpoint_bytes(workdir: pathlib.Path, step: int) -> int:
  """Bytes of a workdir's checkpoint at `step`, plus its base's latest for heads-only ones."""
  total = manifest_lib.directory_bytes(workdir / checkpointing.CHECKPOINT_DIRNAME / str(step))
  base = checkpointing.base_reference(workdir)
  if base is not None:
    steps = checkpointing.Checkpointer(base, read_only=True)
    try:
      latest = max(steps.all_steps())
    finally:
      steps.close()
    total += manifest_lib.directory_bytes(base / checkpointing.CHECKPOINT_DIRNAME / str(latest))
  return total
