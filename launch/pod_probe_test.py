"""launch.pod_probe: one line per path, exit 1 when one is not there."""

import subprocess
import sys

from launch import pod_probe


def test_reachable_and_unreachable_paths_are_one_line_each(tmp_path, capsys):
  missing = tmp_path / 'nope'
  assert pod_probe.main(['3', str(tmp_path), str(missing)]) == 1
  assert capsys.readouterr().out.splitlines() == [
      f'mtp-check 3 reachable {tmp_path}',
      f'mtp-check 3 unreachable {missing}: does not exist',
  ]
  assert pod_probe.main(['0', str(tmp_path)]) == 0


def test_runs_as_a_module(tmp_path):
  done = subprocess.run([sys.executable, '-m', 'launch.pod_probe', '1', str(tmp_path)],
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0 and done.stdout == f'mtp-check 1 reachable {tmp_path}\n'
