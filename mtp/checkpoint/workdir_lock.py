"""One writer per workdir: a lock file beside the workdir, `<workdir>.lock`.

Training and `launch.import_weights` hold it while they write (in a multi-host run, process 0
does); `launch.export`, `launch.prepare_data` and `launch.convert_layout` hold their output's
while they build it beside it and rename it into place. The file records the holder (pid, host,
command, start time) and is removed on exit.

On a local file system the file is also `flock`ed, so the kernel releases the lock when its
holder dies: a file left by a process of this host that died (kill -9) is stale, and is taken
over with a warning. A lock held by a live process, or recorded by one on another host (which
this host cannot check), is refused with an error naming the holder and saying how to clear it:
delete the file. On an object store (`gs://...`) the file is a best-effort marker, checked and
written through `etils.epath` without atomicity (a writer reads its record back and gives way
if another writer's replaced it, which narrows a race of two launches to the same moment but
cannot close it); there a recorded pid that is dead on this host makes it stale, and one from
another host must be deleted by hand.

The lock sits beside the workdir, not in it, so that an import can still build its workdir in
a staging directory and rename it into place, and a copied workdir carries no lock along.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import socket
import sys
import time
from typing import Any

from absl import logging

SUFFIX = '.lock'


class WorkdirLockedError(RuntimeError):
  """Another process holds the workdir."""


def lock_path(workdir: str | os.PathLike) -> str:
  """`<workdir>.lock`, beside the workdir (a URL stays a URL)."""
  workdir = os.fspath(workdir).rstrip('/')
  if not _is_url(workdir):
    workdir = os.path.abspath(workdir)
  return workdir + SUFFIX


def _is_url(path: str) -> bool:
  return '://' in path


def _holder_record() -> dict[str, Any]:
  return {'pid': os.getpid(), 'host': socket.gethostname(),
          'command': ' '.join(sys.argv)[:500], 'since': time.strftime('%Y-%m-%d %H:%M:%S')}


def _describe(record: dict[str, Any] | None) -> str:
  if not record:
    return 'an unknown process (the lock file is empty or unreadable)'
  return (f'pid {record.get("pid")} on host {record.get("host")!r} since {record.get("since")} '
          f'({record.get("command", "")!r})')


def _parse(text: str) -> dict[str, Any] | None:
  try:
    record = json.loads(text)
  except ValueError:
    return None
  return record if isinstance(record, dict) else None


def _is_stale(record: dict[str, Any] | None) -> bool:
  """The recorded holder ran on this host and is gone."""
  if not record or record.get('host') != socket.gethostname():
    return False
  pid = record.get('pid')
  if not isinstance(pid, int) or pid <= 0:
    return False
  if pid == os.getpid():
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # Alive, under another user.
    return False
  return False


def _refusal(path: str, workdir: str, record: dict[str, Any] | None) -> WorkdirLockedError:
  return WorkdirLockedError(
      f'{workdir} is in use by {_describe(record)}: {path} locks it. Two writers would overwrite '
      'each other\'s files. If that process is gone (another host, say), delete '
      f'{path} and run again.')


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the workdir's lock, or raises WorkdirLockedError."""

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = os.fspath(workdir)
    self.path = lock_path(workdir)
    self._fd: int | None = None
    self._marker = False

  def acquire(self) -> None:
    if _is_url(self.path):
      self._acquire_marker()
    else:
      self._acquire_local()

  def release(self) -> None:
    if self._fd is not None:
      try:
        os.unlink(self.path)  # Before unlocking: a waiter then sees the inode change.
      except FileNotFoundError:
        pass
      os.close(self._fd)
      self._fd = None
    elif self._marker:
      from etils import epath
      try:
        epath.Path(self.path).unlink()
      except FileNotFoundError:
        pass
      self._marker = False

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def _acquire_local(self) -> None:
    import fcntl
    pathlib.Path(self.path).parent.mkdir(parents=True, exist_ok=True)
    for _ in range(10):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        raise _refusal(self.path, self.workdir, self._read_local()) from None
      try:
        same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same_file = False
      if not same_file:  # Its holder removed it while we waited: try the new file.
        os.close(fd)
        continue
      record = _parse(os.pread(fd, 1 << 16, 0).decode('utf-8', 'replace'))
      if record and record.get('host') != socket.gethostname():
        # Unlocked here, yet its holder may live on another host (a file system whose locks
        # do not reach across hosts): this host cannot tell.
        os.close(fd)
        raise _refusal(self.path, self.workdir, record)
      if record and record.get('pid') != os.getpid():
        # The kernel released its lock: the holder died (its pid may even run something else).
        logging.warning('Taking over the stale lock %s of %s, which no longer runs.', self.path,
                        _describe(record))
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
      os.fsync(fd)
      self._fd = fd
      return
    raise WorkdirLockedError(f'{self.path}: could not take the lock (it keeps changing).')

  def _read_local(self) -> dict[str, Any] | None:
    try:
      return _parse(pathlib.Path(self.path).read_text(errors='replace'))
    except OSError:
      return None

  def _acquire_marker(self) -> None:
    from etils import epath
    path = epath.Path(self.path)
    if path.exists():
      record = _parse(path.read_text())
      if not _is_stale(record):
        raise _refusal(self.path, self.workdir, record)
      logging.warning('Taking over the stale lock %s of %s, which no longer runs.', self.path,
                      _describe(record))
    mine = _holder_record()
    path.write_text(json.dumps(mine))
    # An object store has no create-if-absent here: of two writers racing past the check above,
    # the one whose record was overwritten reads the other's back and gives way.
    record = _parse(path.read_text())
    if record != mine:
      raise _refusal(self.path, self.workdir, record)
    self._marker = True
