"""The workdir lock: one holder, named when refused; stale locks taken over; released on exit."""

import json
import os
import socket
import subprocess
import sys

import pytest

from mtp.checkpoint import workdir_lock


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait()
  return proc.pid


def test_a_second_holder_is_refused_with_the_holder_named(tmp_path):
  workdir = tmp_path / 'w'
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; from mtp.checkpoint import workdir_lock as l; '
       f'lock = l.WorkdirLock({str(workdir)!r}); lock.acquire(); print("held", flush=True); '
       'time.sleep(60)'], stdout=subprocess.PIPE, text=True,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(workdir_lock.__file__))))
  try:
    assert holder.stdout.readline().strip() == 'held'
    with pytest.raises(workdir_lock.WorkdirLockedError) as e:
      workdir_lock.WorkdirLock(workdir).acquire()
    message = str(e.value)
    assert f'pid {holder.pid}' in message and socket.gethostname() in message
    assert f'delete {workdir}.lock' in message
  finally:
    holder.kill()
    holder.wait()
  # Killed: the kernel released its lock, and the file it left is stale.
  with workdir_lock.WorkdirLock(workdir):
    assert json.loads((tmp_path / 'w.lock').read_text())['pid'] == os.getpid()
  assert not (tmp_path / 'w.lock').exists()


def test_the_same_process_cannot_hold_it_twice(tmp_path):
  with workdir_lock.WorkdirLock(tmp_path / 'w'):
    with pytest.raises(workdir_lock.WorkdirLockedError, match=f'pid {os.getpid()}'):
      workdir_lock.WorkdirLock(tmp_path / 'w').acquire()


def test_a_stale_lock_of_a_dead_pid_does_not_block(tmp_path):
  path = tmp_path / 'w.lock'
  path.write_text(json.dumps({'pid': _dead_pid(), 'host': socket.gethostname()}))
  with workdir_lock.WorkdirLock(tmp_path / 'w'):
    assert json.loads(path.read_text())['pid'] == os.getpid()
  assert not path.exists()


def test_a_lock_from_another_host_is_refused(tmp_path):
  path = tmp_path / 'w.lock'
  path.write_text(json.dumps({'pid': 1, 'host': 'elsewhere'}))
  with pytest.raises(workdir_lock.WorkdirLockedError, match="host 'elsewhere'.*delete"):
    workdir_lock.WorkdirLock(tmp_path / 'w').acquire()
  assert path.exists()


def test_the_object_store_marker(tmp_path):
  """The best-effort marker (used for gs:// paths), exercised on a local path."""
  lock = workdir_lock.WorkdirLock(tmp_path / 'w')
  lock._acquire_marker()
  with pytest.raises(workdir_lock.WorkdirLockedError, match='elsewhere|pid'):
    workdir_lock.WorkdirLock(tmp_path / 'w')._acquire_marker()
  lock.release()
  assert not (tmp_path / 'w.lock').exists()
  (tmp_path / 'w.lock').write_text(json.dumps({'pid': _dead_pid(),
                                               'host': socket.gethostname()}))
  workdir_lock.WorkdirLock(tmp_path / 'w')._acquire_marker()
  assert workdir_lock.lock_path('gs://bucket/run/') == 'gs://bucket/run.lock'
