"""The divergence guard: a step whose loss or gradient norm is not finite is not applied, and
more of them than `max_bad_steps` stop training without saving, naming the step.

On device, each train step keeps the previous parameters and optimizer state when its own are
not finite (`keep_if_finite`, a select XLA fuses into the update; on finite steps it returns the
new state bit for bit) and reports `skipped` in its metrics. On the host, `Guard` looks at those
metrics only where the loop fetches them anyway: at the first step (blocked on for the
throughput), at log steps, and before every checkpoint save (which waits for the state). So it
adds no host sync, a diverged state is never saved, and checkpoint rotation never deletes the
last good checkpoints for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

# The metrics whose values must be finite.
WATCHED = ('loss', 'grad_norm')


class DivergenceError(RuntimeError):
  """Training diverged: a non-finite loss or gradient norm (more than `max_bad_steps` times)."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def finite(metrics: dict) -> jax.Array:
  """True when every watched metric is finite (traced)."""
  return jnp.all(jnp.stack([jnp.isfinite(metrics[k]) for k in WATCHED if k in metrics]))


def keep_if_finite(ok: jax.Array, new, old):
  """`new` where `ok`, else `old` (pytrees of the same structure; traced)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class Guard:
  """Counts the bad steps of a run, from metrics the loop has fetched or is about to.

  Args:
    max_bad_steps: bad steps skipped before training stops (0: stop at the first).
  """

  def __init__(self, max_bad_steps: int = 0):
    self.max_bad_steps = max_bad_steps
    self.bad_steps: list[int] = []
    self._pending: list[tuple[int, dict]] = []

  def add(self, step: int, metrics: dict) -> None:
    """Keeps a step's metrics (device arrays) for the next `check`; no host sync."""
    self._pending.append((step, {k: metrics[k] for k in WATCHED if k in metrics}))

  def check(self) -> None:
    """Fetches the kept metrics; raises DivergenceError past `max_bad_steps` bad steps."""
    pending, self._pending = self._pending, []
    for step, values in jax.device_get(pending):
      bad = {k: float(v) for k, v in values.items() if not np.isfinite(v)}
      if not bad:
        continue
      self.bad_steps.append(step)
      described = ', '.join(f'{k} {v}' for k, v in bad.items())
      if len(self.bad_steps) > self.max_bad_steps:
        raise DivergenceError(
            f'Training diverged at step {step} ({described}); bad steps so far: '
            f'{self.bad_steps}, max_bad_steps={self.max_bad_steps}. Nothing was saved after the '
            'last good checkpoint, which is kept: resume from it with a lower '
            'optim.learning_rate, or allow skipped steps with --config.max_bad_steps.', step)
      logging.warning('Step %d skipped: %s (bad step %d of at most %d).', step, described,
                      len(self.bad_steps), self.max_bad_steps)
