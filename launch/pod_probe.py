"""Runs on each worker of a pod before training (launch.tpu_pod): can this worker see PATHs?

  python3 -m launch.pod_probe WORKER PATH [PATH ...]

Prints one line per path, `mtp-check WORKER reachable PATH` or
`mtp-check WORKER unreachable PATH: why`, and exits 1 if any is unreachable.

It stats each path with etils.epath, the library launch.train reads and writes its workdir and
data with: for `gs://` that is gcsfs (the `gcs` extra launch.tpu_pod installs), with the
worker's own credentials (its service account), so a missing bucket, a missing extra or a
denied permission shows here as it would in training, before the pod starts.
"""

from __future__ import annotations

import sys
from typing import Sequence

PREFIX = 'mtp-check'


def probe(path: str) -> str | None:
  """None if `path` exists as this process sees it, else why not (one line)."""
  try:
    from etils import epath  # pylint: disable=import-outside-toplevel
    if epath.Path(path).exists():
      return None
    return 'does not exist'
  except Exception as e:  # noqa: BLE001  Any failure (import, auth, network) is the answer.
    text = str(e).strip().splitlines()
    return f'{type(e).__name__}: {text[0]}' if text else type(e).__name__


def main(argv: Sequence[str]) -> int:
  if len(argv) < 2:
    print('usage: python3 -m launch.pod_probe WORKER PATH [PATH ...]', file=sys.stderr)
    return 2
  worker, paths = argv[0], argv[1:]
  failed = 0
  for path in paths:
    why = probe(path)
    if why is None:
      print(f'{PREFIX} {worker} reachable {path}', flush=True)
    else:
      failed += 1
      print(f'{PREFIX} {worker} unreachable {path}: {why}', flush=True)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
