"""The measurement cache's guard against timings taken under other work."""

import logging
import os
import subprocess
import sys
import time

import pytest

from mtp.decode import measurements


class _FakeWatch:

  def __init__(self, cores):
    self._cores = cores

  def cores(self):
    return self._cores


def test_other_work_counts_another_process_not_this_one(monkeypatch):
  monkeypatch.undo()  # The real `machine_quiet`, not the conftest's busy machine.
  monkeypatch.setattr(measurements, '_quiet_verdict', None)
  spinner = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
  try:
    time.sleep(0.3)  # Started.
    watch = measurements.OtherWork()
    time.sleep(0.5)
    # At least one core runs the spinner all along (more where the other test worker is busy).
    assert watch.cores() > 2 * measurements.BUSY_CORES
    assert not measurements.machine_quiet()
  finally:
    spinner.kill()
    spinner.wait()


def test_other_work_leaves_out_this_process_threads(monkeypatch):
  """Every thread of this process is taken off: a timing's own work is not load."""
  busy = iter([100.0, 103.0])  # CPU seconds of every process: 3 s in 2 s of wall time...
  own = iter([10.0, 12.5])  # ...of which this process used 2.5 s.
  wall = iter([50.0, 52.0])
  monkeypatch.setattr(measurements, '_busy_cpu_seconds', lambda cpus: next(busy))
  monkeypatch.setattr(measurements.time, 'process_time', lambda: next(own))
  monkeypatch.setattr(measurements.time, 'monotonic', lambda: next(wall))
  assert measurements.OtherWork().cores() == pytest.approx(0.25)


def test_machine_quiet_only_where_it_can_tell(monkeypatch):
  monkeypatch.undo()  # The real `machine_quiet`, not the conftest's busy machine.
  monkeypatch.setattr(measurements, '_quiet_verdict', None)
  monkeypatch.setattr(measurements, 'QUIET_SAMPLE_SECONDS', 0.01)
  monkeypatch.setattr(measurements, '_busy_cpu_seconds', lambda cpus: 100.0)  # Nothing else runs.
  assert measurements.machine_quiet()
  monkeypatch.setattr(measurements, '_quiet_verdict', None)
  monkeypatch.setattr(measurements, '_busy_cpu_seconds', lambda cpus: None)  # No /proc/stat.
  assert measurements.OtherWork().cores() is None
  assert not measurements.machine_quiet()  # So nothing is measured again.


def test_machine_quiet_looks_once_per_verdict(monkeypatch):
  """Every `mtp.generate` call looks up every break-even: one look serves them a while."""
  monkeypatch.undo()  # The real `machine_quiet`, not the conftest's busy machine.
  monkeypatch.setattr(measurements, '_quiet_verdict', None)
  monkeypatch.setattr(measurements, 'QUIET_SAMPLE_SECONDS', 0.01)
  looks = []
  monkeypatch.setattr(measurements, '_busy_cpu_seconds', lambda cpus: looks.append(1) or 100.0)
  assert measurements.machine_quiet() and measurements.machine_quiet()
  assert len(looks) == 2  # One watch: its start and its end.
  monkeypatch.setattr(measurements, 'QUIET_VERDICT_SECONDS', 0.0)
  assert measurements.machine_quiet()
  assert len(looks) == 4


def test_only_the_cpus_this_process_may_use_count(tmp_path, monkeypatch):
  """Load on other CPUs does not slow this process (a container's cores on a larger host)."""
  stat = tmp_path / 'stat'
  stat.write_text('cpu  300 0 30 900 0 0 0 0 0 0\n'  # user nice system idle ... steal
                  'cpu0 100 0 10 300 0 0 0 0 0 0\n'
                  'cpu1 200 0 20 600 5 1 2 3 0 0\n'
                  'intr 1 2 3\n')
  monkeypatch.setattr(measurements, '_PROC_STAT', str(stat))
  tick = os.sysconf('SC_CLK_TCK')
  assert measurements._busy_cpu_seconds(None) == pytest.approx(330 / tick)
  assert measurements._busy_cpu_seconds(frozenset({0})) == pytest.approx(110 / tick)
  assert measurements._busy_cpu_seconds(frozenset({1})) == pytest.approx(226 / tick)  # Not iowait.
  assert measurements._busy_cpu_seconds(frozenset({7})) is None  # Not listed: cannot tell.
  stat.write_text('cpu0 1 2\n')
  assert measurements._busy_cpu_seconds(frozenset({0})) is None


def test_note_load_records_the_load_and_warns_when_disturbed(caplog):
  entry = {'break_even': 1.5}
  assert measurements.note_load(entry, _FakeWatch(0.01234), 'x') == {
      'break_even': 1.5, measurements.OTHERS_CORES: 0.012}
  assert not caplog.records
  with caplog.at_level(logging.WARNING):
    noted = measurements.note_load(entry, _FakeWatch(1.0), 'the break-even of kind 1')
  assert measurements.disturbed(noted) and not measurements.disturbed(entry)
  assert 'the break-even of kind 1' in caplog.text and '1.00 CPU cores' in caplog.text
  assert measurements.note_load(entry, _FakeWatch(None), 'x') == entry  # Unknown: as before.


@pytest.mark.parametrize('cores,quiet,measured_again', [
    (1.0, True, True),  # Disturbed, and the machine is quiet now.
    (1.0, False, False),  # Still busy: measuring again would read no better.
    (0.0, True, False),
    (None, True, False),  # Entries cached before the load was noted.
])
def test_a_disturbed_timing_is_measured_again_once_the_machine_is_quiet(
    tmp_path, monkeypatch, cores, quiet, measured_again):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  monkeypatch.setattr(measurements, 'machine_quiet', lambda: quiet)
  entry = {'break_even': 1.5}
  if cores is not None:
    entry[measurements.OTHERS_CORES] = cores
  measurements.store('t.json', 'k', entry)
  found = measurements.lookup('t.json', 'k', lambda e: e['break_even'] > 0)
  assert found == (None if measured_again else entry)
