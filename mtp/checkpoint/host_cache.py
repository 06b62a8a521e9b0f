"""Where this host keeps its caches, readable before JAX starts (`mtp.compilation_cache`) and
without epath: `paths` re-exports what it needs."""

from __future__ import annotations

import os
import pathlib

DEFAULT_ROOT = os.path.join('~', '.cache', 'mtp')


def is_url(path: str | os.PathLike) -> bool:
  """A path on an object store (`gs://`, `s3://`, ...), not on a local file system."""
  return '://' in os.fspath(path)


def root() -> pathlib.Path:
  """The directory of this host's caches, written with local file APIs (the standard
  library's corpora, token arrays, local copies of remote files, staging directories, compiled
  programs): `$MTP_CACHE_DIR` when it is a local path, else ~/.cache/mtp."""
  configured = os.environ.get('MTP_CACHE_DIR')
  return pathlib.Path(configured if configured and not is_url(configured)
                      else os.path.expanduser(DEFAULT_ROOT))
