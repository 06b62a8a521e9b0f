"""convert_workdir takes the output's lock, as every writer of a workdir does."""

import os

import pytest

from mtp.checkpoint import convert_layout
from mtp.checkpoint import workdir_lock


def test_a_conversion_to_a_locked_output_is_refused(tiny_workdir, tmp_path):
  output = tmp_path / 'scanned'
  with workdir_lock.WorkdirLock(output):  # As another conversion (or a trainer) holds it.
    with pytest.raises(workdir_lock.WorkdirLockedError, match=f'is in use by pid {os.getpid()}'):
      convert_layout.convert_workdir(tiny_workdir, output, scan_layers=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == []
