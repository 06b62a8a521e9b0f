"""Documents of a corpus, streamed one at a time, each assigned to the train or valid split.

A source is one of:
  - a directory of text or code files (`extensions` picks them), or `stdlib`, the running
    interpreter's standard library (as `data.corpus='stdlib'` reads it);
  - a JSONL file, one JSON object a line, the text in `text_field`;
  - a Parquet file, the text in column `text_field`, read one record batch at a time;
  - a glob pattern (`dumps/*.parquet`) naming JSONL or Parquet files, read in sorted order.

The validation split is held out by a stable hash of each document's key (`corpora.unit_hash`):
a file's path below the directory, or for records the `id_field` value if given, else the text.
When the hash puts no document in valid although `valid_fraction > 0` and there are at least two
documents, the one with the smallest hash goes there (as `corpora.split_files` does), so a tiny
corpus still has a valid split. For a directory the split is exactly `corpora.split_files`'s.
Records are never all held in memory: at most one document is held back (the smallest-hash train
document, until a valid one appears), so it may reach the train split a little later than its
place in the file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
import glob
import json
import pathlib
from typing import Any

from mtp.data import corpora

STDLIB = 'stdlib'
RECORD_SUFFIXES = {'.jsonl': 'jsonl', '.parquet': 'parquet'}
# Rows per Parquet record batch: bounds memory whatever the row groups' sizes.
PARQUET_BATCH_ROWS = 1024


class SourceError(ValueError):
  """A source that cannot be read as documents (missing, empty, malformed)."""


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: inline `text` (records) or a file `path` to read (directories).

  A file is read where it is tokenized (a worker process), so the parent never holds its text.
  """
  key: str
  text: str | None = None
  path: str | None = None


@dataclasses.dataclass
class Source:
  """A corpus to stream: `kind` is 'directory' or 'records'.

  For a directory, `files` are its sorted files and `root` their folder, and `other_files`
  counts the files there that `extensions` left out; for records, `files` are the JSONL /
  Parquet files.
  """
  spec: str
  kind: str
  files: list[pathlib.Path]
  root: pathlib.Path | None = None
  text_field: str = 'text'
  id_field: str = ''
  skipped_nulls: int = 0
  other_files: int = 0

  def describe(self) -> dict[str, Any]:
    """What the manifest records about the source."""
    out: dict[str, Any] = {'spec': self.spec, 'kind': self.kind, 'num_files': len(self.files)}
    if self.kind == 'records':
      out.update(text_field=self.text_field, id_field=self.id_field)
    return out

  def split_documents(self, valid_fraction: float) -> Iterator[tuple[str, Document]]:
    """('train' | 'valid', document) for every document, in a fixed order."""
    if not 0.0 <= valid_fraction < 1.0:
      raise SourceError(f'valid_fraction must be in [0, 1), got {valid_fraction}.')
    if self.kind == 'directory':
      _, valid = corpora.split_files(self.files, valid_fraction, self.root)
      in_valid = set(valid)
      for path in self.files:
        key = path.relative_to(self.root).as_posix()
        yield ('valid' if path in in_valid else 'train'), Document(key=key, path=str(path))
      return
    yield from _split_by_hash(self._records(), valid_fraction)

  def _records(self) -> Iterator[Document]:
    for path in self.files:
      if path.suffix == '.jsonl':
        yield from self._jsonl(path)
      else:
        yield from self._parquet(path)

  def _document(self, text: Any, identifier: Any, where: str) -> Document | None:
    if text is None:
      self.skipped_nulls += 1
      return None
    if not isinstance(text, str):
      raise SourceError(f'{where}: field {self.text_field!r} is a {type(text).__name__}, not '
                        'text.')
    if self.id_field and identifier is None:
      raise SourceError(f'{where}: has no id field {self.id_field!r}.')
    return Document(key=str(identifier) if self.id_field else text, text=text)

  def _jsonl(self, path: pathlib.Path) -> Iterator[Document]:
    with path.open(encoding='utf-8', errors='replace') as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        where = f'{path}:{number}'
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise SourceError(f'{where}: not valid JSON ({e}).') from e
        if not isinstance(record, dict) or self.text_field not in record:
          raise SourceError(f'{where}: has no field {self.text_field!r} (set --text_field).')
        doc = self._document(record[self.text_field], record.get(self.id_field), where)
        if doc is not None:
          yield doc

  def _parquet(self, path: pathlib.Path) -> Iterator[Document]:
    import pyarrow.parquet as pq  # Only Parquet sources need pyarrow.
    try:
      parquet = pq.ParquetFile(path)
    except Exception as e:  # pylint: disable=broad-except  # pyarrow raises several types.
      raise SourceError(f'{path} is not a readable Parquet file ({e}).') from e
    columns = [self.text_field] + ([self.id_field] if self.id_field else [])
    missing = [c for c in columns if c not in parquet.schema_arrow.names]
    if missing:
      raise SourceError(f'{path} has no column {missing[0]!r}; it has '
                        f'{parquet.schema_arrow.names} (set --text_field / --id_field).')
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
      texts = batch.column(self.text_field).to_pylist()
      ids = (batch.column(self.id_field).to_pylist() if self.id_field
             else [None] * len(texts))
      for text, identifier in zip(texts, ids):
        doc = self._document(text, identifier, f'{path} row {row}')
        row += 1
        if doc is not None:
          yield doc


def _split_by_hash(docs: Iterator[Document], valid_fraction: float
                   ) -> Iterator[tuple[str, Document]]:
  """Streams documents into splits by `unit_hash(key) < valid_fraction` (see module doc)."""
  held: tuple[float, Document] | None = None  # The smallest-hash train document so far.
  seen_valid, count = False, 0
  for doc in docs:
    count += 1
    value = corpora.unit_hash(doc.key)
    if value < valid_fraction:
      seen_valid = True
      yield 'valid', doc
      if held is not None:
        yield 'train', held[1]
        held = None
    elif seen_valid or valid_fraction == 0:
      yield 'train', doc
    elif held is None or value < held[0]:
      if held is not None:
        yield 'train', held[1]
      held = (value, doc)
    else:
      yield 'train', doc
  if held is not None:
    yield ('valid' if not seen_valid and count >= 2 else 'train'), held[1]


def open_source(spec: str, *, text_field: str = 'text', id_field: str = '',
                extensions: Sequence[str] = ('.py',)) -> Source:
  """The source `spec` names (see module doc); raises SourceError if it has no documents."""
  if not spec:
    raise SourceError('No source given: pass a directory, a .jsonl or .parquet file, a glob of '
                      f'them, or {STDLIB!r}.')
  if spec == STDLIB:
    return Source(spec, 'directory', corpora.stdlib_files(), corpora.stdlib_root())
  if any(c in spec for c in '*?['):
    files = [pathlib.Path(p) for p in sorted(glob.glob(spec)) if pathlib.Path(p).is_file()]
    if not files:
      raise SourceError(f'No file matches the source pattern {spec!r}.')
  else:
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
      try:
        files = corpora.list_files(path, extensions)
      except ValueError as e:
        raise SourceError(str(e)) from e
      return Source(spec, 'directory', files, path,
                    other_files=corpora.count_files(path) - len(files))
    if not path.exists():
      raise SourceError(f'Source {spec!r} does not exist.')
    files = [path]
  unknown = [p for p in files if p.suffix not in RECORD_SUFFIXES]
  if unknown:
    raise SourceError(f'Source file {str(unknown[0])!r} is neither a directory nor one of '
                      f'{sorted(RECORD_SUFFIXES)}.')
  if not text_field:
    raise SourceError('text_field must name the field holding the text.')
  return Source(spec, 'records', files, text_field=text_field, id_field=id_field)
