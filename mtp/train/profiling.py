"""`config.profile_steps`: a `jax.profiler` trace of a few train steps under `workdir/profile`.

The setting is a string:
  ''      no trace (the default);
  'N'     steps N, N+1 and N+2 (`DEFAULT_NUM_STEPS`);
  'N:M'   steps N to M, both included.
Steps count as `metrics.jsonl` counts them (from 1). The first step of a run also compiles the
train step; trace later steps to see a steady one. A resumed run traces only the steps it runs.

The trace lands in `workdir/profile/plugins/profile/<time>/<host>.xplane.pb` (and a Perfetto
`trace.json.gz` beside it), the layout TensorBoard's profile plugin and xprof read:
`tensorboard --logdir=WORKDIR/profile` or `xprof WORKDIR/profile`.
"""

from __future__ import annotations

import re
from typing import Any

import jax
from absl import logging

DEFAULT_NUM_STEPS = 3
_SPEC = re.compile(r'^\s*(\d+)\s*(?::\s*(\d+)\s*)?$')


class ProfileStepsError(ValueError):
  """A `profile_steps` setting that is not '', 'N' or 'N:M' with 1 <= N <= M."""


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """'N' or 'N:M' -> (first, last) step traced, both included; '' -> None.

  Raises:
    ProfileStepsError: anything else, named.
  """
  spec = '' if spec is None else str(spec)
  if not spec.strip():
    return None
  match = _SPEC.match(spec)
  if not match:
    raise ProfileStepsError(f"profile_steps must be '', 'N' (steps N..N+{DEFAULT_NUM_STEPS - 1}) "
                            f"or 'N:M' (steps N to M), got {spec!r}.")
  first = int(match.group(1))
  last = int(match.group(2)) if match.group(2) is not None else first + DEFAULT_NUM_STEPS - 1
  if first < 1 or last < first:
    raise ProfileStepsError(f'profile_steps {spec!r} must name steps N <= M from 1, got '
                            f'{first}..{last}.')
  return first, last


class StepProfiler:
  """Starts a trace before step `first` and stops it after step `last` has finished.

  Args:
    spec: `config.profile_steps`.
    directory: where the trace goes (`workdir/profile`).
  """

  def __init__(self, spec: str, directory):
    self.steps = parse_profile_steps(spec)
    self.directory = directory
    self.active = False

  def before_step(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      logging.info('Profiling steps %d..%d into %s.', *self.steps, self.directory)
      jax.profiler.start_trace(str(self.directory))
      self.active = True

  def after_step(self, step: int, outputs: Any) -> None:
    """Stops after the last traced step, once its device work (`outputs`) is done."""
    if self.active and step == self.steps[1]:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (a run that ended or stopped inside the traced steps)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
      logging.info('Profile written under %s.', self.directory)
