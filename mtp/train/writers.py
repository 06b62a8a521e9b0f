"""Where training metrics go: metrics.jsonl, TensorBoard event files and a progress bar."""

from __future__ import annotations

import json
import pathlib

from absl import logging
import jax
import tqdm
from tensorboardX import SummaryWriter

METRICS_FILENAME = 'metrics.jsonl'


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
  """All records of workdir/metrics.jsonl in order.

  A last line that does not end the file with a newline and does not parse is a record torn by
  a kill mid-write: it is dropped with a warning (a resuming run rewrites the metrics from its
  checkpoint step anyway). Any other line that is not a JSON object raises a ValueError naming
  the file and line.
  """
  path = pathlib.Path(workdir) / METRICS_FILENAME
  if not path.exists():
    return []
  lines = path.read_bytes().split(b'\n')
  # The file ends with a newline when its last write completed; a kill may tear that write.
  torn = lines.pop()
  records = []
  for number, line in enumerate(lines, start=1):
    if line.strip():
      records.append(_parse_record(line, path, number))
  if torn.strip():
    try:
      records.append(_parse_record(torn, path, len(lines) + 1))
    except ValueError as e:
      logging.warning('Dropping the unfinished last line of %s (a write cut short): %s', path, e)
  return records


def _parse_record(line: bytes, path: pathlib.Path, number: int) -> dict:
  """One metrics record; a ValueError naming `path` and line `number` if it is not one."""
  try:
    record = json.loads(line.decode('utf-8'))
  except ValueError as e:  # UnicodeDecodeError and JSONDecodeError alike.
    raise ValueError(f'{path}, line {number}: not a JSON record ({e}): {line[:80]!r}. Fix or '
                     'delete that line.') from e
  if not isinstance(record, dict):
    raise ValueError(f'{path}, line {number}: expected a JSON object, got {line[:80]!r}. Fix '
                     'or delete that line.')
  return record


class MetricWriter:
  """Writes metric records (dicts with a 'step') from process 0 only.

  On resume, records past the restored step (logged after the last checkpoint of an interrupted
  run) are dropped, so metrics.jsonl reads as one uninterrupted run.
  """

  def __init__(self, workdir: str | pathlib.Path, *, resume_from_step: int = 0,
               progress_total: int = 0, initial: int = 0, show_progress: bool = True):
    self._active = jax.process_index() == 0
    self._path = pathlib.Path(workdir) / METRICS_FILENAME
    self._file = self._tb = self._bar = None
    if not self._active:
      return
    kept = [r for r in read_metrics(workdir) if r.get('step', 0) <= resume_from_step]
    tmp = self._path.with_suffix('.tmp')
    tmp.write_text(''.join(json.dumps(r) + '\n' for r in kept))
    tmp.replace(self._path)
    self._file = self._path.open('a')
    self._tb = SummaryWriter(str(pathlib.Path(workdir) / 'tensorboard'))
    if show_progress:
      self._bar = tqdm.tqdm(total=progress_total, initial=initial, unit='step',
                            dynamic_ncols=True)

  def write(self, record: dict) -> None:
    if not self._active:
      return
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()
    step = record['step']
    for key, value in record.items():
      if key != 'step':
        self._tb.add_scalar(key, value, step)
    if self._bar is not None and 'loss' in record:
      shown = {'loss': f"{record['loss']:.3f}"}
      for key, name in (('ntp_loss', 'ntp'), ('acceptance_proxy', 'accept')):
        if key in record:
          shown[name] = f'{record[key]:.3f}'
      self._bar.set_postfix(**shown, tok_s=f"{record['tokens_per_sec']:,.0f}")

  def advance(self) -> None:
    if self._bar is not None:
      self._bar.update(1)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._tb.close()
    if self._bar is not None:
      self._bar.close()
