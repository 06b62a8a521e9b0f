"""Workdir paths: local directories and object-store URLs (`gs://bucket/run`) alike.

Every file of a workdir (config.json, base.json, the tokenizer, metrics.jsonl, the checkpoints)
is read and written through `etils.epath`, as Orbax reads and writes checkpoints, so a workdir
on Cloud Storage is a path like any other. epath reaches `gs://` through TensorFlow's gfile
when TensorFlow is installed, else through fsspec (`pip install gcsfs`).
"""

from __future__ import annotations

import os

from etils import epath


def is_url(path: str | os.PathLike) -> bool:
  """A path on an object store (`gs://`, `s3://`, ...), not on a local file system."""
  return '://' in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an epath.Path; a local one made absolute (its meaning then does not depend on
  the working directory), a URL kept as it is."""
  if is_url(path):
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.fspath(path)))


def write_text_atomically(path: epath.Path, text: str) -> None:
  """Writes `path` so that a reader sees the old contents or the new, never a part.

  Locally: a temporary sibling renamed over it. On an object store an upload is already
  atomic (an object appears whole or not at all), and a rename is a copy: it is written
  directly.
  """
  path = epath.Path(path)
  if is_url(path):
    path.write_text(text)
    return
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  tmp.write_text(text)
  os.replace(tmp, path)


def local_dir(workdir: str | os.PathLike, name: str) -> epath.Path:
  """`workdir/name` for a local workdir; for one on an object store, a directory of this host
  named after its URL (`$MTP_LOCAL_CACHE`, default ~/.cache/mtp): for caches written with local
  file APIs (the in-memory corpus's token arrays), which a host rebuilds when it lacks them."""
  if not is_url(workdir):
    return as_path(workdir) / name
  root = os.environ.get('MTP_LOCAL_CACHE') or os.path.join(os.path.expanduser('~'), '.cache',
                                                           'mtp')
  flat = os.fspath(workdir).replace('://', '/').strip('/')
  return epath.Path(root) / flat / name
