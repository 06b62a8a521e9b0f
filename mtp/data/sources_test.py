"""Tests for mtp.data.sources."""

import json

import pytest

from mtp.data import corpora
from mtp.data import sources


def _write_jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return path


def _splits(source, fraction):
  out = {'train': [], 'valid': []}
  for split, doc in source.split_documents(fraction):
    out[split].append(doc)
  return out


def test_a_directory_splits_as_the_in_memory_corpus(tmp_path):
  for i in range(30):
    (tmp_path / f'm{i}.py').write_text(f'x = {i}\n')
  (tmp_path / 'skip.txt').write_text('not python')
  source = sources.open_source(str(tmp_path), extensions=('.py',))
  got = _splits(source, 0.2)
  train, valid = corpora.split_files(corpora.list_files(tmp_path, ['.py']), 0.2, tmp_path)
  assert [d.path for d in got['train']] == [str(p) for p in train]
  assert [d.path for d in got['valid']] == [str(p) for p in valid]
  assert got['valid'] and all(d.text is None for d in got['train'])
  assert source.describe() == {'spec': str(tmp_path), 'kind': 'directory', 'num_files': 30}


def test_jsonl_records_split_by_id_or_text(tmp_path):
  records = [{'content': f'doc {i}', 'id': f'id-{i}'} for i in range(200)]
  path = _write_jsonl(tmp_path / 'c.jsonl', records)
  by_text = _splits(sources.open_source(str(path), text_field='content'), 0.1)
  by_id = _splits(sources.open_source(str(path), text_field='content', id_field='id'), 0.1)
  for got, key in ((by_text, 'content'), (by_id, 'id')):
    want_valid = [r['content'] for r in records if corpora.unit_hash(r[key]) < 0.1]
    assert [d.text for d in got['valid']] == want_valid
    assert sorted(d.text for d in got['train'] + got['valid']) == sorted(
        r['content'] for r in records)
  assert [d.key for d in by_id['valid']][0].startswith('id-')


def test_a_tiny_source_still_holds_one_document_out():
  docs = [sources.Document(key=k, text=k) for k in ('a', 'b', 'c')]
  assert all(corpora.unit_hash(k) >= 0.01 for k in 'abc')
  got = list(sources._split_by_hash(iter(docs), 0.01))  # pylint: disable=protected-access
  smallest = min('abc', key=corpora.unit_hash)
  assert [d.key for s, d in got if s == 'valid'] == [smallest]
  assert sorted(d.key for _, d in got) == ['a', 'b', 'c']
  assert [s for s, _ in sources._split_by_hash(iter(docs[:1]), 0.01)] == ['train']  # pylint: disable=protected-access
  assert all(s == 'train' for s, _ in sources._split_by_hash(iter(docs), 0.0))  # pylint: disable=protected-access


def test_parquet_is_read_in_batches(tmp_path, monkeypatch):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  texts = [f'row {i} ' * (i % 5) for i in range(50)]
  texts[7] = None
  pq.write_table(pa.table({'text': texts, 'n': list(range(50))}), tmp_path / 'd.parquet',
                 row_group_size=8)
  monkeypatch.setattr(sources, 'PARQUET_BATCH_ROWS', 4)
  source = sources.open_source(str(tmp_path / '*.parquet'))
  got = _splits(source, 0.0)
  assert [d.text for d in got['train']] == [t for t in texts if t is not None]
  assert source.skipped_nulls == 1
  with pytest.raises(sources.SourceError, match=r"has no column 'body'.*\['text', 'n'\]"):
    list(sources.open_source(str(tmp_path / 'd.parquet'), text_field='body')
         .split_documents(0.0))


def test_bad_sources_are_named(tmp_path):
  with pytest.raises(sources.SourceError, match='does not exist'):
    sources.open_source(str(tmp_path / 'nope.jsonl'))
  with pytest.raises(sources.SourceError, match='No file matches'):
    sources.open_source(str(tmp_path / '*.jsonl'))
  (tmp_path / 'a.csv').write_text('x')
  with pytest.raises(sources.SourceError, match='neither a directory nor one of'):
    sources.open_source(str(tmp_path / 'a.csv'))
  (tmp_path / 'empty').mkdir()
  with pytest.raises(sources.SourceError, match='holds no file with extension'):
    sources.open_source(str(tmp_path / 'empty'))
  path = _write_jsonl(tmp_path / 'b.jsonl', [{'text': 'ok'}, {'body': 'no text'}])
  with pytest.raises(sources.SourceError, match=r"b.jsonl:2: has no field 'text'"):
    list(sources.open_source(str(path)).split_documents(0.0))
  path.write_text('{"text": "ok"}\n{not json\n')
  with pytest.raises(sources.SourceError, match=r'b.jsonl:2: not valid JSON'):
    list(sources.open_source(str(path)).split_documents(0.0))
  path.write_text('{"text": 3}\n')
  with pytest.raises(sources.SourceError, match="field 'text' is a int, not text"):
    list(sources.open_source(str(path)).split_documents(0.0))
  with pytest.raises(sources.SourceError, match='valid_fraction'):
    list(sources.open_source(str(path)).split_documents(1.0))
