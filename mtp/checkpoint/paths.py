"""Workdir paths: local directories and object-store URLs (`gs://bucket/run`) alike.

Every file of a workdir (config.json, base.json, the tokenizer, metrics.jsonl, the checkpoints)
is read and written through `etils.epath`, as Orbax reads and writes checkpoints, so a workdir
on Cloud Storage is a path like any other. epath reaches `gs://` through TensorFlow's gfile
when TensorFlow is installed, else through fsspec (`pip install gcsfs`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import json
import os
import pathlib
import re
import shutil
import threading

from etils import epath

from mtp.checkpoint import host_cache
from mtp.checkpoint.host_cache import is_url

# Copies stream in pieces of this size: a shard of gigabytes never sits in memory whole.
_COPY_BYTES = 16 * 2**20


def _no_listings_cache() -> None:
  """Makes gcsfs (epath's way to `gs://` without TensorFlow) list a directory afresh each time.

  By default it keeps every listing for the life of the process, so a process never sees what
  another wrote after its first look: a checkpoint saved by the trainer on another host, a lock
  taken since. Checkpoint discovery and locks must see the bucket as it is. Only defaults that
  nobody set are changed (fsspec's config, e.g. FSSPEC_GS_USE_LISTINGS_CACHE, still wins).
  """
  try:
    from fsspec import config  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  for protocol in ('gs', 'gcs'):
    config.conf.setdefault(protocol, {}).setdefault('use_listings_cache', False)


_no_listings_cache()

# A URL's scheme (`gs://`, `s3://`, `http://`): RFC 3986's letters, digits, `+`, `-` and `.`.
_SCHEME = re.compile(r'^([a-zA-Z][a-zA-Z0-9+.-]*)://')


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


# The object stores a path may name, with the module epath reaches each through and the
# extra of pyproject.toml that installs it. Only Cloud Storage is tested (tests/gcs_test.py).
REMOTE_SCHEMES = {'gs': ('gcsfs', 'gcs')}


def path_or_url(path: str | os.PathLike, what: str) -> epath.Path:
  """`path` for a component that reads and writes local paths and object-store URLs alike:
  a local path (user-expanded, absolute) or a `gs://` URL, as an epath.Path.

  Raises:
    ValueError: a URL of another scheme, or `gs://` without its client installed; the message
      names `what`, the path and what to do.
  """
  name = scheme(path)
  if not name:
    return as_path(os.path.expanduser(os.fspath(path)))
  if name not in REMOTE_SCHEMES:
    raise ValueError(f'{what}={os.fspath(path)}: {name}:// paths are not supported (use a '
                     f'local path or {", ".join(f"{s}://" for s in REMOTE_SCHEMES)})')
  module, extra = REMOTE_SCHEMES[name]
  try:
    __import__(module)
  except ImportError:
    raise ValueError(f"{what}={os.fspath(path)}: {name}:// paths need {module} (pip install "
                     f"'.[{extra}]')") from None
  return epath.Path(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an epath.Path; a local one made absolute (its meaning then does not depend on
  the working directory), a URL kept as it is."""
  if is_url(path):
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.fspath(path)))


def _private_sibling(path, suffix: str):
  """A hidden sibling of `path` that no other process or thread writes: the temporary file of
  an atomic replace (the data loader's threads fetch the same file at once)."""
  return path.with_name(f'.{path.name}.{os.getpid()}.{threading.get_ident()}.{suffix}')


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
  tmp = _private_sibling(path, 'tmp')
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
  """The directory of caches: `$MTP_CACHE_DIR`, default ~/.cache/mtp.

  It may be a `gs://` URL: decoding's measurements (`decode/measurements.py`, read and written
  through epath) are then shared by every host that sets it, measured once per device kind.
  What must be on this host's disk goes under `host_cache_root()`.
  """
  return epath.Path(os.environ.get('MTP_CACHE_DIR')
                    or os.path.expanduser(host_cache.DEFAULT_ROOT))


def host_cache_root() -> pathlib.Path:
  """`host_cache.root()`: this host's caches, `$MTP_CACHE_DIR` when local, else ~/.cache/mtp."""
  return host_cache.root()


def _flat(url: str | os.PathLike) -> str:
  """A URL as a relative local path (`gs://b/run` -> `gs/b/run`), for host-side copies."""
  return os.fspath(url).replace('://', '/').strip('/')


def local_dir(workdir: str | os.PathLike, name: str) -> epath.Path:
  """`workdir/name` for a local workdir; for one on an object store, a directory of this host
  named after its URL under `host_cache_root()`: for caches written with local file APIs (the
  in-memory corpus's token arrays), which a host rebuilds when it lacks them."""
  if not is_url(workdir):
    return as_path(workdir) / name
  return epath.Path(host_cache_root() / 'workdirs' / _flat(workdir) / name)


def copy_file(source: str | os.PathLike, target: str | os.PathLike) -> None:
  """Streams one file from `source` to `target`, either local or on an object store."""
  with epath.Path(source).open('rb') as reader, epath.Path(target).open('wb') as writer:
    shutil.copyfileobj(reader, writer, _COPY_BYTES)


def upload_tree(local: str | os.PathLike, target: str | os.PathLike,
                last: Sequence[str] = ()) -> int:
  """Copies every file under the local directory `local` to `target` (a URL as a rule),
  the files named in `last` (relative paths, in order) after all others: a reader that takes
  them as the mark of a complete tree never sees a partial one. Returns the files copied.

  An object store has no rename: this is how a tree written locally (by a library that writes
  only local files) is committed to one.
  """
  local, target = pathlib.Path(local), epath.Path(target)
  files = sorted(p.relative_to(local).as_posix() for p in local.rglob('*') if p.is_file())
  missing = [name for name in last if name not in files]
  if missing:
    raise FileNotFoundError(f'{local} lacks {", ".join(missing)}, which marks it complete')
  for name in [f for f in files if f not in last] + list(last):
    (target / name).parent.mkdir(parents=True, exist_ok=True)
    copy_file(local / name, target / name)
  return len(files)


def remove_tree(path: str | os.PathLike) -> None:
  """Removes the directory `path` and everything under it, local or on an object store, if it
  exists."""
  path = epath.Path(path)
  if path.exists():
    path.rmtree()


def list_files(directory: str | os.PathLike, prefix: str = ''
               ) -> Iterator[tuple[epath.Path, str]]:
  """(file, its path relative to `directory`) for every file under `directory`, local or on
  an object store. Not epath's rglob (it refuses `**` on gs://) nor walk (whose directories
  come back without their `gs://`)."""
  for child in sorted(epath.Path(directory).iterdir()):
    if child.is_dir():
      yield from list_files(child, f'{prefix}{child.name}/')
    else:
      yield child, prefix + child.name


def staging_parent(output: str | os.PathLike) -> pathlib.Path:
  """Where a directory bound for `output` is written first, with local file APIs: beside a
  local `output` (a rename then commits it), or for a URL under this host's cache, named after
  the URL's parent (then uploaded: an object store has no rename)."""
  if not is_url(output):
    return pathlib.Path(os.path.abspath(os.fspath(output))).parent
  return host_cache_root() / 'staging' / _flat(epath.Path(output).parent)


def local_copy(path: str | os.PathLike) -> pathlib.Path:
  """`path` itself if local; for a file on an object store, a copy on this host, for readers
  that take only local files (memory maps, ArrayRecord's reader).

  Copies live under `host_cache_root()/remote/`, named after the URL, and are fetched once: again
  only when the object's size or modification time changes. A copy appears whole or not at all
  (written beside, then renamed), so hosts, processes and threads may fetch the same file at
  once.
  """
  if not is_url(path):
    return pathlib.Path(path)
  remote = epath.Path(path)
  stat = remote.stat()
  stamp = json.dumps({'length': stat.length, 'mtime': stat.mtime})
  copy = host_cache_root() / 'remote' / _flat(path)
  stamp_path = copy.with_name(copy.name + '.stamp')
  if copy.is_file() and stamp_path.is_file() and stamp_path.read_text() == stamp:
    return copy
  copy.parent.mkdir(parents=True, exist_ok=True)
  part = _private_sibling(copy, 'part')
  try:
    copy_file(remote, part)
    os.replace(part, copy)
  finally:
    part.unlink(missing_ok=True)
  write_atomically(stamp_path, stamp)
  return copy
