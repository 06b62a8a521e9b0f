"""Self-distillation settings and the trunk caches they need (see `trunk_cache`).

`distill.targets` names what the heads (and a fine-tuned trunk) learn to predict; with
`distill.cache_trunk_states` a frozen trunk runs once over the rows, ahead of training.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import paths
from mtp.train import trunk_cache

# 'text': the corpus; 'teacher': the base trunk's greedy next token on the corpus; 'rollout': the
# base trunk's greedy continuations of prompts cut from the corpus (see `trunk_cache`).
DISTILL_TARGETS = ('text', 'teacher', 'rollout')
# The trunk pass's precision: 'model' (model.dtype), 'float32' or 'bfloat16'.
DISTILL_DTYPES = ('model', 'float32', 'bfloat16')


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid `distill.*` value."""
  distill = config.get('distill')
  if distill is None:
    return
  if distill.targets not in DISTILL_TARGETS:
    raise ValueError(f'distill.targets must be one of {DISTILL_TARGETS}, got '
                     f'{distill.targets!r}.')
  if distill.get('dtype', 'model') not in DISTILL_DTYPES:
    raise ValueError(f'distill.dtype must be one of {DISTILL_DTYPES}, got {distill.dtype!r}.')
  if distill.targets != 'text' and not config.get('init_from'):
    raise ValueError(f"distill.targets={distill.targets!r} needs init_from: the pretrained "
                     'workdir whose trunk is the teacher.')
  if distill.targets == 'rollout':
    if not 1 <= distill.get('prompt_len', 0) < config.data.seq_len:
      raise ValueError('distill.prompt_len must be in [1, data.seq_len), got '
                       f'{distill.get("prompt_len")} for seq_len {config.data.seq_len}.')
    if jax.process_count() > 1:
      raise ValueError("distill.targets='rollout' runs in a single process only.")
  if distill.cache_trunk_states:
    if config.optim.mode != 'frozen_trunk' or not config.get('init_from'):
      raise ValueError('distill.cache_trunk_states needs optim.mode=\'frozen_trunk\' and '
                       f'init_from (got mode {config.optim.mode!r}, init_from '
                       f'{config.get("init_from")!r}): only a frozen trunk\'s states can be '
                       'reused.')
    if jax.process_count() > 1:
      raise ValueError('distill.cache_trunk_states runs in a single process only.')
  if distill.get('soft_labels'):
    if config.optim.mode != 'frozen_trunk' or not config.get('init_from'):
      raise ValueError('distill.soft_labels needs optim.mode=\'frozen_trunk\' and init_from '
                       f'(got mode {config.optim.mode!r}, init_from '
                       f'{config.get("init_from")!r}): the frozen pretrained trunk is the '
                       'teacher whose distributions the heads learn.')
    if not config.model.mtp_num_heads:
      raise ValueError('distill.soft_labels trains heads; model.mtp_num_heads is 0.')
  if distill.batch_size <= 0:
    raise ValueError(f'distill.batch_size must be positive, got {distill.batch_size}.')


def uses_trunk_cache(config: ml_collections.ConfigDict) -> bool:
  distill = config.get('distill')
  return distill is not None and (distill.targets != 'text' or distill.cache_trunk_states)


def pass_dtype(config: ml_collections.ConfigDict) -> str:
  """The precision ('float32' | 'bfloat16') the trunk pass runs in (`distill.dtype`)."""
  name = config.distill.get('dtype', 'model')
  return config.model.dtype if name == 'model' else name


def _teacher(trainer, params: nnx.State, dtype: str) -> tuple[nnx.GraphDef, nnx.State]:
  """The trainer's model definition and `params` for a pass in `dtype`: as they are when that
  is the model's activations' precision, else both in it (`mtp_model.in_precision`)."""
  from mtp.model import mtp_model  # pylint: disable=import-outside-toplevel
  if dtype == trainer.model_config.trunk.dtype:
    return trainer.graphdef, params
  return mtp_model.in_precision(trainer.model_config, params, dtype)


def cached_layer_inputs(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """The trunk layers whose inputs a trunk cache keeps: those the heads' family reads
  (`HeadFamily.trunk_layer_inputs`), when the trunk's states are cached at all."""
  distill = config.get('distill')
  if distill is None or not distill.get('cache_trunk_states'):
    return ()
  from mtp.model import mtp_model  # pylint: disable=import-outside-toplevel
  return tuple(mtp_model.ModelConfig.from_config(config.model).trunk_layer_inputs)


def batch_fields(config: ml_collections.ConfigDict) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The optional `step.Batch` fields of (train, eval) batches: what `with_trunk_cache` adds."""
  if not uses_trunk_cache(config):
    return (), ()
  distill = config.distill
  fields = []
  if distill.targets != 'text':
    fields.append(trunk_cache.TARGETS)
  if distill.targets == 'rollout':
    fields.append(trunk_cache.HEAD_MASK)
  if distill.cache_trunk_states:
    fields.append(trunk_cache.HIDDEN)
  if cached_layer_inputs(config):
    fields.append(trunk_cache.LAYER_INPUTS)
  # Only rollouts replace the eval rows too; otherwise evaluation reads the text.
  rolled_out_eval = distill.targets == 'rollout' and config.eval_steps
  return tuple(fields), tuple(fields) if rolled_out_eval else ()


def with_trunk_cache(config: ml_collections.ConfigDict, workdir: pathlib.Path, trainer,
                     arrays: dict[str, np.ndarray], base_params: Callable[[], nnx.State],
                     max_rows: int | None = None) -> dict[str, np.ndarray]:
  """The rows plus what `distill` asks of the init_from trunk, built once under the workdir.

  With distill.targets='rollout' the rows themselves are replaced: at most `max_rows` prompts
  cut from them, each continued greedily by the trunk. `base_params` gives the parameters with
  the base trunk (called only when something has to be built).

  Args:
    trainer: the `step.Trainer` (its graph definition and trunk settings).
    arrays: packed rows, `tokens`, `segment_ids`, `positions` [N, T] int32.
  """
  source = paths.as_path(config.init_from)
  checkpointer = checkpointing.Checkpointer(source, read_only=True)
  try:
    source_step = checkpointer.latest_step()
  finally:
    checkpointer.close()
  distill = config.distill
  store_hidden = bool(distill.cache_trunk_states)
  layers = cached_layer_inputs(config)
  dtype = pass_dtype(config)
  # The pass's precision, not the training's, decides what the cache holds.
  trunk = dataclasses.replace(trainer.model_config.trunk, dtype=dtype)
  description = f'{trunk}|{source}|step {source_step}'
  states = trunk_cache.stored_names(store_hidden, bool(layers))
  if distill.targets == 'rollout':
    prompts = trunk_cache.rollout_prompts(arrays, distill.prompt_len)[:max_rows]
    seq_len = arrays['tokens'].shape[1]
    key = trunk_cache.cache_key({'prompts': prompts}, f'{description}|rollout to {seq_len}',
                                store_hidden, layers)
    names = ['tokens', 'segment_ids', 'positions', trunk_cache.TARGETS,
             trunk_cache.HEAD_MASK] + states
  else:
    key = trunk_cache.cache_key(arrays, description, store_hidden, layers)
    names = [trunk_cache.TARGETS] + states
  # Built with local file APIs (memory maps) on this host; a workdir on an object store keeps a
  # copy, so a run resumed on another host fetches it instead of building it again.
  directory = pathlib.Path(paths.local_dir(workdir, 'trunk_cache')) / key
  kept = paths.as_path(workdir) / 'trunk_cache' / key if paths.is_url(workdir) else None
  is_kept = kept is not None and all((kept / f'{name}.npy').exists() for name in names)
  if all((directory / f'{name}.npy').exists() for name in names):
    cached = trunk_cache.load(directory, names)
  elif is_kept:
    cached = {name: np.load(paths.local_copy(kept / f'{name}.npy'), mmap_mode='r')
              for name in names}
  elif distill.targets == 'rollout':
    # The teacher is always the source's trunk, also when resuming a fine-tuned one.
    graphdef, params = _teacher(trainer, base_params(), dtype)
    rollout = functools.partial(trunk_cache.rollout_forward(graphdef, seq_len, layers), params)
    logging.info('Greedy continuations by the trunk of %s of %d prompts of %d tokens, to %d '
                 'tokens, in %s -> %s.', source, prompts.shape[0], prompts.shape[1], seq_len,
                 dtype, directory)
    cached = trunk_cache.build_rollouts(prompts, rollout, directory, seq_len=seq_len,
                                        batch_size=distill.batch_size,
                                        store_hidden=store_hidden,
                                        store_layer_inputs=bool(layers))
  else:
    graphdef, params = _teacher(trainer, base_params(), dtype)
    forward = functools.partial(trunk_cache.trunk_forward(graphdef, layers), params)
    logging.info('One pass of the trunk of %s over %d rows in %s -> %s.', source,
                 arrays['tokens'].shape[0], dtype, directory)
    cached = trunk_cache.build(arrays, forward, directory, batch_size=distill.batch_size,
                               store_hidden=store_hidden, store_layer_inputs=bool(layers))
  if kept is not None and not is_kept:
    paths.upload_tree(directory, kept)  # Each file whole; the set counts once all are there.
  if distill.targets == 'rollout':
    return cached
  if distill.targets == 'text':
    del cached[trunk_cache.TARGETS]
  return {**arrays, **cached}
