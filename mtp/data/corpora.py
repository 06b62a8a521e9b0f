"""Real text and code available offline: the Python standard library, its prose, a directory,
held-out code.

`data.corpus` names one source or a mix of them joined by '+', e.g. 'stdlib+stdlib_prose':
  * 'stdlib': the running interpreter's standard-library `.py` sources;
  * 'stdlib_prose': the standard library's English prose, materialized once as `.txt` files
    (`stdlib_prose_root`): the language reference's topics that `help()` shows and the
    longer docstrings of every module, one file each;
  * any other value: a directory, read for `data.extensions`.

Everything here is deterministic: file lists are sorted and the train/valid split depends only on
each file's path relative to the corpus root (a SHA-1 hash), so it is the same on every run and
machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import ast
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from typing import Any

from mtp.checkpoint import paths

EXCLUDED_DIRS = frozenset({'test', 'tests', 'idle_test', 'site-packages', 'dist-packages',
                           '__pycache__'})
DEFAULT_HELDOUT_PACKAGES = ('ml_collections', 'absl')
STDLIB = 'stdlib'
STDLIB_PROSE = 'stdlib_prose'
STDLIB_TESTS = 'stdlib_tests'
NAMED_SOURCES = (STDLIB, STDLIB_TESTS, STDLIB_PROSE)
MIX_SEPARATOR = '+'
# A docstring shorter than this is mostly a signature's gloss ("Return the size."), not prose.
_MIN_DOCSTRING_CHARS = 200
_PROSE_FORMAT = 1  # Bump when what `stdlib_prose_root` writes changes.


def _walk(root: pathlib.Path, suffixes: tuple[str, ...],
          skip_dirs: frozenset[str]) -> list[pathlib.Path]:
  """Sorted files under `root` ending with `suffixes`; skips `skip_dirs` and hidden dirs."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith('.')]
    found.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(suffixes))
  return sorted(p for p in found if p.is_file())


def stdlib_root() -> pathlib.Path:
  """The running interpreter's standard-library directory."""
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def stdlib_files() -> list[pathlib.Path]:
  """Sorted `.py` sources of the standard library, without test directories or site-packages."""
  root = stdlib_root()
  files = _walk(root, ('.py',), EXCLUDED_DIRS)
  if not files:
    raise ValueError(f'No standard-library .py files found under {root}.')
  return files


_LISTED_SKIP_DIRS = frozenset({'__pycache__'})


def stdlib_test_files() -> list[pathlib.Path]:
  """Sorted `.py` files of the standard library's own test suite (`<stdlib>/test`).

  Distributions often ship it apart (Debian's libpython3-testsuite) or not at all; a
  source build keeps it. Raises ValueError when this interpreter has none.
  """
  root = stdlib_root() / 'test'
  files = _walk(root, ('.py',), _LISTED_SKIP_DIRS) if root.is_dir() else []
  # A stripped install keeps test/support and a few helpers: not a test suite.
  if len(files) < 100:
    raise ValueError(f'This interpreter has no standard-library test suite under {root} '
                     f'({len(files)} .py files).')
  return files


def list_files(directory: str | pathlib.Path, extensions: Iterable[str]) -> list[pathlib.Path]:
  """Sorted files under `directory` whose name ends with one of `extensions`.

  Recursive; hidden directories and `__pycache__` are skipped.
  """
  directory = pathlib.Path(directory)
  extensions = tuple(e if e.startswith('.') else f'.{e}' for e in extensions)
  if not directory.is_dir():
    raise ValueError(f'Corpus directory {str(directory)!r} does not exist or is not a '
                     'directory.')
  files = _walk(directory, extensions, _LISTED_SKIP_DIRS)
  if not files:
    raise ValueError(f'Corpus directory {str(directory)!r} holds no file with extension '
                     f'{list(extensions)}.')
  return files


def count_files(directory: str | pathlib.Path) -> int:
  """How many files `list_files` looks at under `directory`, whatever their extension."""
  return len(_walk(pathlib.Path(directory), ('',), _LISTED_SKIP_DIRS))


def unit_hash(key: str) -> float:
  """A stable pseudo-random number in [0, 1) from a string."""
  digest = hashlib.sha1(key.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64


def split_files(paths: Sequence[pathlib.Path], valid_fraction: float,
                root: str | pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """(train, valid) by a hash of each path relative to `root`; both keep the input order.

  When the hash puts no file in valid although `valid_fraction > 0` and there are at least two
  files, the file with the smallest hash goes to valid, so a tiny corpus still has a valid split.
  """
  if not 0.0 <= valid_fraction < 1.0:
    raise ValueError(f'valid_fraction must be in [0, 1), got {valid_fraction}.')
  root = pathlib.Path(root)
  hashes = [unit_hash(pathlib.Path(p).relative_to(root).as_posix()) for p in paths]
  is_valid = [h < valid_fraction for h in hashes]
  if valid_fraction > 0 and len(paths) >= 2 and not any(is_valid):
    is_valid[min(range(len(paths)), key=hashes.__getitem__)] = True
  train = [p for p, v in zip(paths, is_valid) if not v]
  valid = [p for p, v in zip(paths, is_valid) if v]
  return train, valid


def read_text(path: str | pathlib.Path) -> str:
  """UTF-8 text of a file; undecodable bytes become U+FFFD."""
  return pathlib.Path(path).read_text(encoding='utf-8', errors='replace')


class TextReader:
  """Reads corpus files as text, skipping binary files and counting badly encoded ones.

  A corpus directory may hold files that only look like text by their extension. What is done:
  - a file with a NUL byte is binary (no text or source file holds one): skipped, since its
    decoded bytes would only teach the model noise;
  - a file that is not valid UTF-8 (say one Latin-1 comment in a source file) is mostly useful
    text: kept, with each undecodable byte read as U+FFFD, as before.
  Both are counted; `report` logs one warning with the counts and an example path of each.
  """

  def __init__(self):
    self.binary: list[pathlib.Path] = []
    self.undecodable: list[pathlib.Path] = []

  def read(self, path: str | pathlib.Path) -> str | None:
    """The text of `path`, or None for a binary file."""
    path = pathlib.Path(path)
    data = path.read_bytes()
    if b'\0' in data:
      self.binary.append(path)
      return None
    try:
      return data.decode('utf-8')
    except UnicodeDecodeError:
      self.undecodable.append(path)
      return data.decode('utf-8', errors='replace')

  def report(self, what: str = 'corpus') -> None:
    """Logs a warning if any file read so far was binary or not valid UTF-8."""
    parts = []
    if self.binary:
      parts.append(f'skipped {len(self.binary)} binary file(s) (NUL bytes), e.g. '
                   f'{self.binary[0]}')
    if self.undecodable:
      parts.append(f'read {len(self.undecodable)} file(s) that are not valid UTF-8 with '
                   f'U+FFFD for the bad bytes, e.g. {self.undecodable[0]}')
    if parts:
      logging.warning('Reading the %s: %s.', what, '; '.join(parts))


def corpus_sources(corpus: str) -> list[str]:
  """The sources a `data.corpus` value names: one, or several joined by '+'."""
  sources = [part.strip() for part in str(corpus).split(MIX_SEPARATOR)]
  if not all(sources):
    raise ValueError(f'data.corpus {corpus!r} names an empty source; expected one of '
                     f'{list(NAMED_SOURCES)}, a directory, or several joined by {MIX_SEPARATOR!r}.')
  if len(set(sources)) != len(sources):
    raise ValueError(f'data.corpus {corpus!r} names a source twice.')
  return sources


def source_root(source: str) -> pathlib.Path:
  """Root directory of one corpus source."""
  if source == STDLIB:
    return stdlib_root()
  if source == STDLIB_PROSE:
    return stdlib_prose_root()
  if source == STDLIB_TESTS:
    return stdlib_root() / 'test'
  return pathlib.Path(source).expanduser()


def source_files(source: str, extensions: Iterable[str]) -> list[pathlib.Path]:
  """Sorted files of one corpus source (`extensions` filter a directory only)."""
  if source == STDLIB:
    return stdlib_files()
  if source == STDLIB_PROSE:
    return list_files(stdlib_prose_root(), ('.txt',))
  if source == STDLIB_TESTS:
    return stdlib_test_files()
  return list_files(source_root(source), extensions)


def copy_corpus(corpus: str, extensions: Iterable[str], directory: str | pathlib.Path) -> str:
  """Copies each source of `corpus` into `directory/<n>-<name>` and returns the `data.corpus`
  naming the copies: the same files, splits and mix on a machine whose interpreter differs
  (or has no test suite). Relative paths are kept, so the train/valid split is the same."""
  directory = pathlib.Path(directory)
  copies = []
  for index, source in enumerate(corpus_sources(corpus)):
    root = source_root(source)
    name = source if source in NAMED_SOURCES else root.name
    target = directory / f'{index}-{name}'
    for path in source_files(source, extensions):
      copy = target / path.relative_to(root)
      copy.parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(path, copy)
    copies.append(str(target))
  return MIX_SEPARATOR.join(copies)


def corpus_root(data_config: Any) -> pathlib.Path:
  """Root directory of `data_config.corpus`; for a mix, the folder holding all its roots."""
  roots = [source_root(s) for s in corpus_sources(data_config.corpus)]
  return roots[0] if len(roots) == 1 else pathlib.Path(os.path.commonpath(roots))


def corpus_files(data_config: Any) -> list[pathlib.Path]:
  """Sorted files of `data_config.corpus` (each source's in turn, for a mix)."""
  return [f for files in source_file_lists(data_config, 'all') for f in files]


def source_file_lists(data_config: Any, split: str) -> list[list[pathlib.Path]]:
  """Files of `split` ('train', 'valid' or 'all') of each source of `data_config.corpus`.

  Each source is split on its own, by paths relative to its own root, so a source's split is
  the same alone or in a mix, on every machine.
  """
  lists = []
  for source in corpus_sources(data_config.corpus):
    files = source_files(source, data_config.extensions)
    if split != 'all':
      train, valid = split_files(files, data_config.valid_fraction, source_root(source))
      files = {'train': train, 'valid': valid}[split]
    lists.append(files)
  return lists


def corpus_splits(data_config: Any) -> dict[str, list[pathlib.Path]]:
  """{'train': [...], 'valid': [...]} for `data_config` (corpus, extensions, valid_fraction)."""
  return {split: [f for files in source_file_lists(data_config, split) for f in files]
          for split in ('train', 'valid')}


def _cache_root() -> pathlib.Path:
  return paths.host_cache_root()


def stdlib_prose_texts() -> dict[str, str]:
  """{file name: text} of the standard library's prose.

  * `topics/<name>.txt`: the language reference's topics as `help()` shows them
    (`pydoc_data.topics`, about 0.5 MB of English);
  * `docstrings/<module>.txt`: the docstrings of at least 200 characters of each module of
    `stdlib_files()` (module, classes and functions, in source order), cleaned of their
    indentation and separated by blank lines.
  """
  texts = {}
  try:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    texts.update({f'topics/{name}.txt': text for name, text in sorted(topics.topics.items())})
  except ImportError:
    logging.warning('This interpreter has no pydoc_data: stdlib_prose holds docstrings only.')
  root = stdlib_root()
  for path in stdlib_files():
    try:
      tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):  # Files for other Python versions, lib2to3 fixtures.
      continue
    docs = []
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
          docs.append(doc)
    if docs:
      module = path.relative_to(root).with_suffix('').as_posix().replace('/', '.')
      texts[f'docstrings/{module}.txt'] = '\n\n'.join(docs) + '\n'
  return texts


def stdlib_prose_root() -> pathlib.Path:
  """A directory of the standard library's prose (`stdlib_prose_texts`), built once.

  It lives under $MTP_CACHE_DIR (default ~/.cache/mtp), keyed by the interpreter's version and
  standard-library path, and is written to a temporary sibling and renamed, so a reader never
  sees half of it.
  """
  key = hashlib.sha1(f'{_PROSE_FORMAT}|{sys.version}|{stdlib_root()}'.encode()).hexdigest()[:12]
  directory = _cache_root() / 'corpora' / f'stdlib_prose-{key}'
  if directory.is_dir():
    return directory
  directory.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f'.{directory.name}.', dir=directory.parent))
  try:
    for name, text in stdlib_prose_texts().items():
      (staging / name).parent.mkdir(parents=True, exist_ok=True)
      (staging / name).write_text(text, encoding='utf-8')
    staging.rename(directory)
  except OSError:
    if not directory.is_dir():  # Not another process that got there first.
      raise
  finally:
    if staging.exists():
      shutil.rmtree(staging, ignore_errors=True)
  return directory


def heldout_files(packages: Sequence[str] = DEFAULT_HELDOUT_PACKAGES) -> list[pathlib.Path]:
  """Sorted `.py` sources of installed non-stdlib packages: code the model never trained on.

  Packages that are not installed are skipped; raises ValueError if none is found.
  """
  files: list[pathlib.Path] = []
  for name in packages:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      continue
    for location in spec.submodule_search_locations:
      files.extend(_walk(pathlib.Path(location), ('.py',), EXCLUDED_DIRS))
  if not files:
    raise ValueError(f'None of the packages {list(packages)} is installed.')
  return sorted(set(files))
