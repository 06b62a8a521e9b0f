"""Preemption: SIGTERM becomes a request to save a checkpoint and stop at a step boundary; the
loop then raises `Preempted`, so that callers (and, through launch.train's exit code, schedulers)
can tell a preempted run from a finished one."""

from __future__ import annotations

import signal

from absl import logging


class Preempted(Exception):
  """Training stopped on SIGTERM after saving its checkpoint at `step`; run again to resume."""

  def __init__(self, step: int):
    super().__init__(f'preempted (SIGTERM): saved a checkpoint at step {step}; run the same '
                     'command again to resume.')
    self.step = step


class StopRequest:
  """Within `with StopRequest() as stop:`, SIGTERM sets `stop.requested` instead of killing."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread: no signal handling.
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM received: saving a checkpoint and stopping.')
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
