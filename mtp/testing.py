"""Test helpers: the environment of processes a test starts, and what a test session builds
once for all its processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import importlib.util
import multiprocessing
import os
import pathlib
import shutil
from typing import Callable, Iterator

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


def built_once(name: str, build: Callable[[pathlib.Path], object]) -> pathlib.Path:
  """The folder `name` in this test session's folder (`MTP_TEST_SESSION_DIR`, which conftest.py
  makes for the session and its xdist workers and removes at its end), made by `build(folder)`
  once: the first process to ask builds it while the others wait, then all read it. What each
  worker would otherwise build again (an imported model, a reference loaded the slow way) is
  built once a session, and never read by the next one."""
  root = pathlib.Path(os.environ['MTP_TEST_SESSION_DIR']) / 'built'
  root.mkdir(parents=True, exist_ok=True)
  folder, done = root / name, root / f'{name}.done'
  # Not `{name}.lock`: a workdir's writers lock that file (`workdir_lock`).
  with open(root / f'{name}.building', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released as the file closes, or its process dies.
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)  # Left by a process that died building it.
      build(folder)
      done.touch()
  return folder


def require(*modules: str) -> None:
  """Skips the test where one of `modules` is not installed, without importing any."""
  import pytest  # pylint: disable=import-outside-toplevel
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f'needs {", ".join(missing)}')


@contextlib.contextmanager
def oracle_process(*modules: str) -> Iterator[concurrent.futures.Executor]:
  """A process of its own for a test's reference implementation, which needs `modules` (torch,
  transformers): submit it module-level functions of numpy arrays and paths. The test process
  never imports them, so it never holds torch's threads beside JAX's (torch was a suspect for
  the suite's XLA:CPU crashes: Makefile). Skips the test where one of `modules` is not
  installed."""
  require(*modules)
  # Spawned, not forked: a fork of a process running XLA's threads may deadlock.
  with concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context('spawn')) as pool:
    yield pool
