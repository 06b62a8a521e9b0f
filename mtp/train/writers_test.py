"""Tests for mtp.train.writers: metrics.jsonl survives torn writes and names bad lines."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from mtp import testing
from mtp.train import writers

RECORDS = [{'step': 1, 'loss': 3.0}, {'step': 2, 'loss': 2.5}, {'step': 3, 'loss': 2.0}]


def _write(workdir, text: str | bytes):
  path = workdir / writers.METRICS_FILENAME
  if isinstance(text, str):
    text = text.encode()
  path.write_bytes(text)
  return path


def _lines(records):
  return ''.join(json.dumps(r) + '\n' for r in records)


def test_read_metrics_round_trip(tmp_path):
  assert writers.read_metrics(tmp_path) == []
  _write(tmp_path, _lines(RECORDS) + '\n')  # A blank line is no record.
  assert writers.read_metrics(tmp_path) == RECORDS


@pytest.mark.parametrize('tail', ['{"step": 4, "lo', '{', '\x00\x00\x00', '7'])
def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog, tail):
  # A kill mid-write leaves part of the last record and no final newline.
  path = _write(tmp_path, _lines(RECORDS) + tail)
  with caplog.at_level('WARNING'):
    assert writers.read_metrics(tmp_path) == RECORDS
  assert any(str(path) in r.getMessage() and 'unfinished last line' in r.getMessage()
             for r in caplog.records)


@pytest.mark.parametrize('bad, number', [
    ('{"step": 2, "loss": 2.5\n', 2),  # garbled in the middle
    ('[1, 2]\n', 2),  # JSON, but not a record
    (b'\xff\xfe{}\n', 2),  # not UTF-8
    ('{"step": 4, "lo\n', 4),  # the last line, but complete: not a torn write
])
def test_a_garbled_line_is_named_by_file_and_line(tmp_path, bad, number):
  bad = bad if isinstance(bad, bytes) else bad.encode()
  lines = [_lines([r]).encode() for r in RECORDS]
  lines.insert(number - 1, bad)
  path = _write(tmp_path, b''.join(lines))
  with pytest.raises(ValueError, match=re.escape(f'{path}, line {number}:')):
    writers.read_metrics(tmp_path)


def test_resume_rewrites_the_metrics_without_a_torn_line(tmp_path):
  path = _write(tmp_path, _lines(RECORDS) + '{"step": 4, "lo')
  writer = writers.MetricWriter(tmp_path, resume_from_step=2, show_progress=False)
  writer.write({'step': 3, 'loss': 1.0})
  writer.close()
  assert writers.read_metrics(tmp_path) == [*RECORDS[:2], {'step': 3, 'loss': 1.0}]
  assert path.read_text().endswith('\n')


def test_training_does_not_import_torch():
  """tensorboardX imports torch where it is installed (0.9 s and its memory for each process
  that trains); hidden from that import, torch still imports afterwards."""
  script = ("import sys; import mtp.train.trainer; assert 'torch' not in sys.modules; "
            "import torch; torch.zeros(1)")
  if importlib.util.find_spec('torch') is None:
    pytest.skip('torch is not installed')
  subprocess.run([sys.executable, '-c', script], check=True, env=testing.child_env(),
                  timeout=300)
