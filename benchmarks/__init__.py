"""Benchmarks: side-by-side ratios measured in one run, written as JSON (and plots) under
results/."""

import json
import pathlib


def write_json(path: str | pathlib.Path, data) -> pathlib.Path:
  """Writes `data` as indented JSON to `path` (its directory created), says so, returns it."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=2))
  print(f'\nwrote {path}')
  return path
