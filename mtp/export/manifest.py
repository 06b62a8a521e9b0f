"""`export.json`: what an export directory holds, written last inside it, read without JAX.

Every export directory has one. `mtp.load` and `launch.generate` read it to tell an export
from a training workdir, and the jax_export runtime reads its artifact section. It records:
  format        'params' | 'hf' | 'jax_export'
  dtype         the floating-point type the parameters were written in
  source        the workdir exported (absolute path, or URL) and its checkpoint step
  created       UTC time; jax_version, mtp_version
  <format>      the format's own summary (the jax_export programs, sizes, ...)
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from etils import epath

from mtp.checkpoint import paths

FILENAME = 'export.json'


def read(directory: str | os.PathLike) -> dict[str, Any] | None:
  """The manifest of an export directory, or None when `directory` is no export.

  Raises:
    ValueError: the manifest exists but is not a JSON object with a "format" (names the file).
  """
  path = epath.Path(directory) / FILENAME  # A workdir may be on an object store.
  if not path.is_file():
    return None
  try:
    record = json.loads(path.read_text(encoding='utf-8'))
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{path} is corrupt: not valid JSON ({e}).') from None
  if not isinstance(record, dict) or not isinstance(record.get('format'), str):
    raise ValueError(f'{path} is corrupt: expected a JSON object with a "format" string.')
  return record


def write(directory: pathlib.Path, record: dict[str, Any]) -> None:
  """Writes the manifest (the export's last file: a directory without one is incomplete)."""
  (directory / FILENAME).write_text(json.dumps(record, indent=2, sort_keys=True) + '\n',
                                    encoding='utf-8')


def directory_bytes(directory: str | os.PathLike) -> int:
  """Bytes of every regular file under `directory`, local or on an object store (the
  training checkpoint a params export is compared with may be on one)."""
  if not paths.is_url(directory):
    return sum(p.stat().st_size for p in pathlib.Path(directory).rglob('*') if p.is_file())
  return sum(path.stat().length for path, _ in paths.list_files(directory))
