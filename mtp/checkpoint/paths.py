"""Workdir paths: local directories and object-store URLs (`gs://bucket/run`) alike.

Every file of a workdir (config.json, base.json, the tokenizer, metrics.jsonl, the checkpoints)
is read and written through `etils.epath`, as Orbax reads and writes checkpoints, so a workdir
on Cloud Storage is a path like any other. epath reaches `gs://` through TensorFlow's gfile
when TensorFlow is installed, else through fsspec (`pip install gcsfs`).
"""

from __future__ import annotations

import os
import pathlib
import re

from etils import epath

# A URL's scheme (`gs://`, `s3://`, `http://`): RFC 3986's letters, digits, `+`, `-` and `.`.
_SCHEME = re.compile(r'^([a-zA-Z][a-zA-Z0-9+.-]*)://')


def is_url(path: str | os.PathLike) -> bool:
  """A path on an object store (`gs://`, `s3://`, ...), not on a local file system."""
  return '://' in os.fspath(path)


def scheme(path: str | os.PathLike) -> str:
  """The URL scheme of `path` as written (`gs` for gs://...), '' for a local path."""
  match = _SCHEME.match(os.fspath(path))
  return match.group(1) if match else ''


def local_path(path: str | os.PathLike, what: str) -> pathlib.Path:
  """`path` as a pathlib.Path, for a component that reads or writes only local files.

  pathlib folds `gs://b/x` into the local `gs:/b/x`; a URL is refused here instead, before
  anything is read or written.

  Args:
    path: the path as the user gave it.
    what: the flag or config key it came from (`--output`, `config.data.source`), named in
      the error.

  Raises:
    ValueError: `path` has a URL scheme (`gs://`, `s3://`, ...); the message names `what`,
      the path and the scheme.
  """
  name = scheme(path)
  if name:
    raise ValueError(f'{what}={os.fspath(path)}: {name}:// paths are not supported '
                     'here yet; use a local path')
  return pathlib.Path(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an epath.Path; a local one made absolute (its meaning then does not depend on
  the working directory), a URL kept as it is."""
  if is_url(path):
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.fspath(path)))


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `path` so that a reader sees the old contents or the new, never a part: the
  project's one way to replace a file.

  Locally: a temporary sibling renamed over it (removed if writing fails). On an object store
  an upload is already atomic (an object appears whole or not at all), and a rename is a copy:
  it is written directly.
  """
  path = epath.Path(path)
  write = path.write_bytes if isinstance(data, bytes) else path.write_text
  if is_url(path):
    write(data)
    return
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  try:
    if isinstance(data, bytes):
      tmp.write_bytes(data)
    else:
      tmp.write_text(data, encoding='utf-8')
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
  """`write_atomically` of text."""
  write_atomically(path, text)


def cache_root() -> epath.Path:
  """The one directory of this host's caches: `$MTP_CACHE_DIR`, default ~/.cache/mtp (the
  standard library's corpora, decoding's measurements, local copies of remote workdirs')."""
  return epath.Path(os.environ.get('MTP_CACHE_DIR')
                    or os.path.join(os.path.expanduser('~'), '.cache', 'mtp'))


def local_dir(workdir: str | os.PathLike, name: str) -> epath.Path:
  """`workdir/name` for a local workdir; for one on an object store, a directory of this host
  named after its URL under `cache_root()`: for caches written with local file APIs (the
  in-memory corpus's token arrays), which a host rebuilds when it lacks them."""
  if not is_url(workdir):
    return as_path(workdir) / name
  flat = os.fspath(workdir).replace('://', '/').strip('/')
  return cache_root() / 'workdirs' / flat / name
