"""The long-context phase: the last `long_context.steps` steps of a run train on longer rows.

Short rows are cheaper to train on (attention's cost grows with the row), but a model trained
only on rows of L tokens has never attended over a distance beyond L, and reads longer prompts
worse the further they go (measured on the demo model: held-out loss 5.47 at positions 0-127,
5.81 at 768-1023, trained at 256). Pretraining recipes end with a context-extension stage for
this; here it is the run's last steps, on the same corpus packed into longer rows, with their own
shuffled iterator (seeded apart from the first phase's), saved in the checkpoints like the first.
"""

from __future__ import annotations

import ml_collections

from mtp.parallel import mesh as mesh_lib


def num_steps(config: ml_collections.ConfigDict) -> int:
  """Steps in the long-context phase (0 without one; configs saved before it had none)."""
  long_context = config.get('long_context')
  return int(long_context.steps) if long_context is not None else 0


def first_step(config: ml_collections.ConfigDict) -> int | None:
  """The first step that reads long rows (steps count from 1), or None without the phase."""
  steps = num_steps(config)
  return config.num_train_steps - steps + 1 if steps else None


def in_phase(config: ml_collections.ConfigDict, step: int) -> bool:
  """True if training step `step` (counting from 1) reads long rows."""
  first = first_step(config)
  return first is not None and step >= first


def data_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config.data` as the phase reads it: rows of `long_context.seq_len` tokens."""
  data = config.data.copy_and_resolve_references()
  data.seq_len = config.long_context.seq_len
  data.batch_size = config.long_context.batch_size
  return data


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the first invalid long_context value."""
  steps = num_steps(config)
  if steps == 0:
    return
  long_context = config.long_context
  if not 0 < steps <= config.num_train_steps:
    raise ValueError(f'long_context.steps must be between 0 and num_train_steps '
                     f'({config.num_train_steps}), got {steps}.')
  if long_context.seq_len <= config.data.seq_len:
    raise ValueError(f'long_context.seq_len ({long_context.seq_len}) must exceed data.seq_len '
                     f'({config.data.seq_len}): the phase trains on longer rows.')
  if long_context.seq_len > config.model.max_seq_len:
    raise ValueError(f'long_context.seq_len ({long_context.seq_len}) exceeds the model\'s '
                     f'maximum sequence length model.max_seq_len ({config.model.max_seq_len}).')
  if long_context.batch_size < 1:
    raise ValueError(f'long_context.batch_size must be at least 1, got '
                     f'{long_context.batch_size}.')
  if num_devices is not None:
    try:
      mesh_lib.check_batch_fits(long_context.batch_size,
                                mesh_lib.resolve_mesh_shape(config.mesh, num_devices))
    except mesh_lib.MeshError as e:
      raise mesh_lib.MeshError(str(e).replace('data.batch_size', 'long_context.batch_size')
                               ) from None
