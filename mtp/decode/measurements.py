"""What decoding measures once and reuses, in one cache with one writer.

Everything lives under `paths.cache_root()` (`$MTP_CACHE_DIR`, default ~/.cache/mtp), in
`decode/`, one table per kind of measurement:
  * `step_cost.json`: the cost curves of verification passes and of whole drafting steps, by
    device kind and model (`cost_model.step_cost`);
  * `break_even.json`: what a drafting step costs in one-token steps, by device, model, batch and
    block (`auto.break_even`);
  * `head_accuracies.json`: the heads' top-k accuracies, by the weights they were measured on
    (`calibration.head_accuracies`);
  * `token_counts/<key>.npy`: a training corpus's token counts, by corpus and tokenizer
    (`draft_vocab.corpus_counts`).
Each file is only a cache: an unreadable one, or an entry that does not hold what its reader
expects, is named in a warning and measured again. Writes re-read the table first (another
process may have added entries) and replace the file atomically; a read-only cache is measured
again next time instead of failing.

A timing notes the CPU other processes used, on the CPUs it may run on, while it ran
(`OtherWork`, as `OTHERS_CORES` in its entry): where that passes `BUSY_CORES`, it is used and
kept, and measured again by the first process that finds it while the machine is quiet
(`lookup`). Taking the fastest of several runs does not undo sustained load, and one disturbed
break-even, once cached, misjudged drafting in every later run on that machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from typing import Any, Callable

import numpy as np
from etils import epath

from mtp.checkpoint import paths

DIRECTORY = 'decode'
# The field of a timing's entry that holds the CPU cores other processes kept busy meanwhile.
OTHERS_CORES = 'others_cores'
# Other processes' average CPU use, in cores, beyond which a timing counts as disturbed. A quiet
# 2-core machine here reads 0.00-0.01; one other process spinning reads 1.00.
BUSY_CORES = 0.25
# How long `machine_quiet` watches the machine, and how long its verdict stands: each
# `mtp.generate` call resolves its plan and looks up every break-even, so on a machine that stays
# busy, a look per disturbed entry would add a second to every call.
QUIET_SAMPLE_SECONDS = 0.25
QUIET_VERDICT_SECONDS = 60.0
_quiet_verdict: tuple[float, bool] | None = None  # (when, quiet) of the last look.


def root() -> epath.Path:
  """The directory of decoding's measurements."""
  return paths.cache_root() / DIRECTORY


def digest(*parts: Any) -> str:
  """A short stable key for what identifies a measurement (JSON-able parts)."""
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha1(text.encode()).hexdigest()[:16]


def read_table(name: str) -> dict:
  """The JSON table `name`; {} when missing or unreadable (it is measured again)."""
  path = root() / name
  try:
    table = json.loads(path.read_bytes())
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    logging.warning('Ignoring the measurement cache %s (%s); measuring again.', path, e)
    return {}
  if not isinstance(table, dict):
    logging.warning('Ignoring the measurement cache %s (not a JSON object); measuring again.',
                    path)
    return {}
  return table


def lookup(name: str, key: str, valid: Callable[[Any], bool]) -> Any | None:
  """Entry `key` of table `name` if `valid(entry)`; None (logged when malformed) otherwise,
  and None for a timing taken under other work (`disturbed`) while the machine is quiet now."""
  entry = read_table(name).get(key)
  if entry is None:
    return None
  try:
    ok = valid(entry)
  except (TypeError, ValueError):
    ok = False
  if not ok:
    logging.warning('Ignoring entry %r of the measurement cache %s (malformed); measuring '
                    'again.', key, root() / name)
    return None
  if disturbed(entry) and machine_quiet():
    logging.info('Entry %r of the measurement cache %s was timed while other processes kept '
                 '%.2f cores busy; the machine is quiet now: measuring again.', key,
                 root() / name, entry[OTHERS_CORES])
    return None
  return entry


def disturbed(entry: Any) -> bool:
  """Whether `entry` is a timing taken while other processes kept `BUSY_CORES` busy."""
  cores = entry.get(OTHERS_CORES) if isinstance(entry, dict) else None
  return isinstance(cores, (int, float)) and cores > BUSY_CORES


_PROC_STAT = '/proc/stat'


def _allowed_cpus() -> frozenset[int] | None:
  """The CPUs this process may run on (XLA:CPU sizes its thread pool by them); None: unknown."""
  try:
    return frozenset(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return None


def _busy_cpu_seconds(cpus: frozenset[int] | None = None) -> float | None:
  """CPU seconds that CPUs `cpus` (None: all) have been busy since boot, steal time included
  (the hypervisor ran other machines on ours), from Linux's /proc/stat; None where it cannot
  tell. Load on CPUs this process may not use does not slow it (a container's few cores on a
  large host)."""
  try:
    with open(_PROC_STAT, encoding='ascii') as f:
      lines = [line.split() for line in f if line.startswith('cpu')]
    busy, found = 0, False
    for fields in lines:
      cpu = fields[0][3:]  # '' for the line that sums every CPU.
      if (cpu == '') != (cpus is None) or (cpu and int(cpu) not in cpus) or len(fields) < 9:
        continue
      user, nice, system, _, _, irq, softirq, steal = map(int, fields[1:9])
      busy, found = busy + user + nice + system + irq + softirq + steal, True
  except (OSError, ValueError):
    return None
  return busy / os.sysconf('SC_CLK_TCK') if found else None


class OtherWork:
  """The CPU that processes other than this one use from its creation on, on the CPUs this one
  may run on.

    watch = OtherWork()
    ...  # time something
    watch.cores()  # e.g. 0.0 on a quiet machine, 1.0 beside one busy process; None: unknown
  """

  def __init__(self):
    self._cpus = _allowed_cpus()
    self._start = (time.monotonic(), _busy_cpu_seconds(self._cpus), time.process_time())

  def cores(self) -> float | None:
    """Other processes' average CPU use since creation, in cores (None: no /proc/stat)."""
    wall_start, busy_start, own_start = self._start
    busy = _busy_cpu_seconds(self._cpus)
    wall = time.monotonic() - wall_start
    if busy is None or busy_start is None or wall <= 0:
      return None
    own = time.process_time() - own_start  # Every thread of this process.
    return max(busy - busy_start - own, 0.0) / wall


def machine_quiet() -> bool:
  """Whether other processes keep less than `BUSY_CORES` busy now (watched for
  `QUIET_SAMPLE_SECONDS`, once per `QUIET_VERDICT_SECONDS`; False where it cannot tell)."""
  global _quiet_verdict
  if _quiet_verdict is not None and time.monotonic() - _quiet_verdict[0] < QUIET_VERDICT_SECONDS:
    return _quiet_verdict[1]
  watch = OtherWork()
  time.sleep(QUIET_SAMPLE_SECONDS)
  cores = watch.cores()
  _quiet_verdict = (time.monotonic(), cores is not None and cores < BUSY_CORES)
  return _quiet_verdict[1]


def note_load(entry: dict, watch: OtherWork, what: str) -> dict:
  """`entry` with the other processes' CPU use `watch` saw (`OTHERS_CORES`), warned of where
  it passes `BUSY_CORES`: `what` names the timing in the warning."""
  cores = watch.cores()
  if cores is None:
    return entry
  if cores > BUSY_CORES:
    logging.warning('Timed %s while other processes kept %.2f CPU cores busy: used and cached '
                    'for now, and measured again when the machine is quiet.', what, cores)
  return {**entry, OTHERS_CORES: round(cores, 3)}


def store(name: str, key: str, entry: Any) -> None:
  """Sets entry `key` of table `name`, keeping the other entries."""
  table = read_table(name)
  table[key] = entry
  _write(root() / name, json.dumps(table, indent=1, sort_keys=True))


def read_array(name: str) -> np.ndarray | None:
  """The .npy array `name`, or None when missing or unreadable (logged)."""
  path = root() / name
  try:
    return np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
  except FileNotFoundError:
    return None
  except Exception as e:  # pylint: disable=broad-except  # numpy and OS errors alike.
    logging.warning('Ignoring the measurement cache %s (%s: %s); measuring again.', path,
                    type(e).__name__, e)
    return None


def write_array(name: str, array: np.ndarray) -> None:
  buffer = io.BytesIO()
  np.save(buffer, array)
  _write(root() / name, buffer.getvalue())


def _write(path: epath.Path, data: str | bytes) -> None:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomically(path, data)
  except OSError as e:
    logging.warning('Cannot write the measurement cache %s (%s); it is measured again next '
                    'time.', path, e)
