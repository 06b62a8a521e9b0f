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
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from typing import Any, Callable

import numpy as np
from etils import epath

from mtp.checkpoint import paths

DIRECTORY = 'decode'


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
  """Entry `key` of table `name` if `valid(entry)`; None (logged when malformed) otherwise."""
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
  return entry


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
