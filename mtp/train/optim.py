"""Optimizer: AdamW with warm-up and cosine decay, clipping, and the three training modes.

The schedule decays over the whole run (`optim.decay_steps=0`), or holds the peak and decays
over the last `decay_steps` only (warmup-stable-decay). The second can be resumed past its
planned end: a run trained at constant rate (`end_lr_fraction=1.0`) to step S, resumed with
num_train_steps = S + N and decay_steps = N, continues exactly and then anneals.

* `joint`: trunk and heads trained together from scratch.
* `frozen_trunk` (Medusa-1): only the heads learn; the trunk's updates are exactly zero.
* `finetune` (Medusa-2): trunk and heads learn together, heads at `head_lr_multiplier` times
  the trunk's learning rate.
Norm scales and biases are not weight-decayed.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from mtp.checkpoint import param_tree

MODES = ('joint', 'frozen_trunk', 'finetune')


def validate(optim_config, num_train_steps: int) -> None:
  if optim_config.mode not in MODES:
    raise ValueError(f'Unknown optim.mode {optim_config.mode!r}; expected one of '
                     f'{", ".join(MODES)}.')
  if optim_config.learning_rate <= 0:
    raise ValueError(f'optim.learning_rate must be positive, got {optim_config.learning_rate}.')
  if optim_config.head_lr_multiplier <= 0:
    raise ValueError('optim.head_lr_multiplier must be positive, got '
                     f'{optim_config.head_lr_multiplier}.')
  if optim_config.warmup_steps < 0:
    raise ValueError(f'optim.warmup_steps must be >= 0, got {optim_config.warmup_steps}.')
  if num_train_steps <= 0:
    raise ValueError(f'num_train_steps must be positive, got {num_train_steps}.')
  if not 0.0 <= optim_config.end_lr_fraction <= 1.0:
    raise ValueError('optim.end_lr_fraction must be between 0 and 1, got '
                     f'{optim_config.end_lr_fraction}.')
  decay = optim_config.get('decay_steps', 0)
  if not 0 <= decay <= num_train_steps:
    raise ValueError(f'optim.decay_steps must be between 0 (decay over the whole run) and '
                     f'num_train_steps ({num_train_steps}), got {decay}.')


def learning_rate_schedule(optim_config, num_train_steps: int, peak: float) -> optax.Schedule:
  """Linear warm-up to `peak`, then cosine decay to end_lr_fraction * peak: over the rest of
  the run, or (decay_steps > 0) over its last decay_steps, holding `peak` until then."""
  decay = optim_config.get('decay_steps', 0)
  if decay:
    stable_end = num_train_steps - decay
    warmup = min(optim_config.warmup_steps, stable_end)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, max(warmup, 1)), optax.constant_schedule(peak),
         optax.cosine_decay_schedule(peak, decay, alpha=optim_config.end_lr_fraction)],
        boundaries=[warmup, stable_end])
  warmup = min(optim_config.warmup_steps, max(num_train_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(num_train_steps, warmup + 1),
      end_value=peak * optim_config.end_lr_fraction)


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim_config, num_train_steps: int, params: nnx.State
                   ) -> optax.GradientTransformation:
  """The optimizer for `params` (used only for its tree structure and group labels)."""
  validate(optim_config, num_train_steps)
  lr = optim_config.learning_rate

  def adamw(peak):
    return optax.adamw(learning_rate_schedule(optim_config, num_train_steps, peak),
                       b1=optim_config.b1, b2=optim_config.b2,
                       weight_decay=optim_config.weight_decay, mask=_decay_mask)

  trunk = optax.set_to_zero() if optim_config.mode == 'frozen_trunk' else adamw(lr)
  heads = adamw(lr * optim_config.head_lr_multiplier)
  return optax.chain(
      optax.clip_by_global_norm(optim_config.grad_clip_norm),
      optax.multi_transform({param_tree.TRUNK: trunk, param_tree.HEADS: heads},
                            param_tree.labels(params)))
