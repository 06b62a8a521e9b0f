"""Test helpers for processes a test starts: their environment."""

from __future__ import annotations

import os

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def child_env(devices: int | None = None, **variables: str) -> dict[str, str]:
  """This process's environment for a child process (a CLI, a notebook kernel, a pod's host):
  the test session's XLA flags (its fast-compiling ones, see conftest.py) and compilation cache
  carry over, its 8 simulated CPU devices do not. `devices` simulates that many instead (one,
  the default, is a user's machine); `variables` are set on top.
  """
  env = dict(os.environ, **variables)
  flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  if devices is not None and devices != 1:
    flags.append(f'{_DEVICE_COUNT_FLAG}={devices}')
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  else:
    env.pop('XLA_FLAGS', None)
  return env
