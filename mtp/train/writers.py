"""Where training metrics go: metrics.jsonl, TensorBoard event files and a progress bar.

The workdir may be local or on an object store (`gs://...`, through `etils.epath`). Locally,
records are appended to metrics.jsonl as they come; an object cannot be appended to, so there
each record rewrites the whole file (small: one line per log step). TensorBoard events on
`gs://` go through tensorboardX's own writer, which needs `google-cloud-storage`; without it
they are left out with a warning.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys

from absl import logging
from etils import epath
import jax
import tqdm

from mtp.checkpoint import paths


@contextlib.contextmanager
def _torch_hidden():
  """Imports inside see torch as not installed, unless it is imported already."""
  hide = 'torch' not in sys.modules
  if hide:
    sys.modules['torch'] = None  # `import torch` raises ImportError.
  try:
    yield
  finally:
    if hide and sys.modules.get('torch', 0) is None:
      del sys.modules['torch']


# tensorboardX imports torch where it is installed, only to name its tensor type: every process
# that trains (the demo, launch scripts, test workers) paid 0.9 s and torch's memory for it.
with _torch_hidden():
  from tensorboardX import SummaryWriter
  from tensorboardX import record_writer

METRICS_FILENAME = 'metrics.jsonl'


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
  """All records of workdir/metrics.jsonl in order.

  A last line that does not end the file with a newline and does not parse is a record torn by
  a kill mid-write: it is dropped with a warning (a resuming run rewrites the metrics from its
  checkpoint step anyway). Any other line that is not a JSON object raises a ValueError naming
  the file and line.
  """
  path = paths.as_path(workdir) / METRICS_FILENAME
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


def _parse_record(line: bytes, path: epath.Path, number: int) -> dict:
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

  def __init__(self, workdir: str | os.PathLike, *, resume_from_step: int = 0,
               progress_total: int = 0, initial: int = 0, show_progress: bool = True):
    self._active = jax.process_index() == 0
    self._path = paths.as_path(workdir) / METRICS_FILENAME
    self._file = self._tb = self._bar = None
    self._lines: list[str] = []  # All of metrics.jsonl, on an object store.
    if not self._active:
      return
    kept = [json.dumps(r) + '\n' for r in read_metrics(workdir)
            if r.get('step', 0) <= resume_from_step]
    paths.write_text_atomically(self._path, ''.join(kept))
    if paths.is_url(self._path):
      self._lines = kept
    else:
      self._file = open(self._path, 'a')
    self._tb = _tensorboard_writer(paths.as_path(workdir) / 'tensorboard')
    if show_progress:
      self._bar = tqdm.tqdm(total=progress_total, initial=initial, unit='step',
                            dynamic_ncols=True)

  def write(self, record: dict) -> None:
    if not self._active:
      return
    line = json.dumps(record) + '\n'
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
    else:
      self._lines.append(line)
      paths.write_text_atomically(self._path, ''.join(self._lines))
    step = record['step']
    for key, value in record.items():
      if key != 'step' and self._tb is not None:
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
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


_WRITER_COUNT = itertools.count()


def _tensorboard_writer(directory: epath.Path) -> SummaryWriter | None:
  """A TensorBoard writer into `directory`, or None (with a warning) where tensorboardX cannot
  write there: `gs://` without google-cloud-storage, `s3://` without boto3, other schemes."""
  if paths.is_url(directory):
    scheme = str(directory).split('://', 1)[0]
    enabled = {'gs': record_writer.GCS_ENABLED, 's3': record_writer.S3_ENABLED}
    if not enabled.get(scheme):
      needs = {'gs': ' (pip install google-cloud-storage)', 's3': ' (pip install boto3)'}
      logging.warning('No TensorBoard events under %s: tensorboardX cannot write there%s. '
                      'metrics.jsonl has every record.', directory, needs.get(scheme, ''))
      return None
  # An event file is named by the second and host it was opened on: a writer opened again in
  # the same second (a run resumed at once) would replace the first one's file. The process and
  # a count keep every writer's file apart.
  return SummaryWriter(str(directory), filename_suffix=f'.{os.getpid()}.{next(_WRITER_COUNT)}')
