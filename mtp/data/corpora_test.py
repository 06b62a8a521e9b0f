"""Tests for mtp.data.corpora."""

import pathlib

import ml_collections
import pytest

from mtp.data import corpora


def _write(root: pathlib.Path, names: list[str]) -> None:
  for name in names:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'# {name}\n')


def test_stdlib_files():
  files = corpora.stdlib_files()
  root = corpora.stdlib_root()
  rel = [f.relative_to(root).as_posix() for f in files]
  assert len(files) > 300
  assert files == sorted(files)
  assert all(f.suffix == '.py' for f in files)
  assert {'os.py', 'json/__init__.py', 'asyncio/tasks.py'} <= set(rel)
  for parts in (pathlib.PurePosixPath(r).parts for r in rel):
    assert not {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages'} & set(parts)


def test_list_files(tmp_path):
  _write(tmp_path, ['b.py', 'a/c.py', 'a/d.txt', 'a/e.md', '.git/f.py', 'a/__pycache__/g.py'])
  assert corpora.list_files(tmp_path, ('.py',)) == [tmp_path / 'a/c.py', tmp_path / 'b.py']
  assert corpora.list_files(tmp_path, ['py', '.txt']) == [
      tmp_path / 'a/c.py', tmp_path / 'a/d.txt', tmp_path / 'b.py']


def test_list_files_errors(tmp_path):
  with pytest.raises(ValueError, match='does not exist'):
    corpora.list_files(tmp_path / 'missing', ('.py',))
  (tmp_path / 'empty').mkdir()
  _write(tmp_path / 'empty', ['notes.txt'])
  with pytest.raises(ValueError, match=r"empty' holds no file"):
    corpora.list_files(tmp_path / 'empty', ('.py',))


def test_split_files_stable_and_disjoint(tmp_path):
  root = pathlib.Path('/x')
  paths = [root / f'pkg/m{i}.py' for i in range(40)]
  train, valid = corpora.split_files(paths, 0.2, root)
  # Fixed by SHA-1 of the relative path: the same on every run and machine.
  assert [p.name for p in valid] == ['m6.py', 'm16.py', 'm23.py', 'm24.py', 'm26.py', 'm30.py']
  assert not set(train) & set(valid)
  assert sorted(train + valid) == sorted(paths)
  assert train == [p for p in paths if p not in valid]  # order kept
  # Only the path relative to the root matters.
  other = pathlib.Path('/elsewhere/deeper')
  _, valid2 = corpora.split_files([other / p.relative_to(root) for p in paths], 0.2, other)
  assert [p.name for p in valid2] == [p.name for p in valid]
  assert corpora.split_files(paths, 0.0, root) == (paths, [])


def test_split_files_tiny_corpus_keeps_a_valid_file():
  root = pathlib.Path('/x')
  paths = [root / 'a.py', root / 'b.py']
  train, valid = corpora.split_files(paths, 0.05, root)
  assert len(train) == 1 and len(valid) == 1
  with pytest.raises(ValueError, match='valid_fraction'):
    corpora.split_files(paths, 1.0, root)


def test_read_text_tolerates_bad_bytes(tmp_path):
  path = tmp_path / 'bad.py'
  path.write_bytes(b'ok = 1\n\xff\xfe bad\n')
  assert corpora.read_text(path) == 'ok = 1\n\ufffd\ufffd bad\n'


def test_text_reader_skips_binary_files_and_counts_bad_utf8(tmp_path, caplog):
  good, latin, binary = tmp_path / 'good.py', tmp_path / 'latin.py', tmp_path / 'blob.py'
  good.write_text('x = "é"\n', encoding='utf-8')
  latin.write_bytes('# caf\xe9\n'.encode('latin-1'))
  binary.write_bytes(b'\x7fELF\x02\x01\x00\x00abc')
  reader = corpora.TextReader()
  assert reader.read(good) == 'x = "é"\n'
  assert reader.read(latin) == '# caf\ufffd\n'
  assert reader.read(binary) is None
  assert reader.binary == [binary] and reader.undecodable == [latin]
  with caplog.at_level('WARNING'):
    reader.report('train split')
  [record] = caplog.records
  assert 'train split' in record.message
  assert f'1 binary file(s) (NUL bytes), e.g. {binary}' in record.message
  assert f'1 file(s) that are not valid UTF-8' in record.message and str(latin) in record.message
  caplog.clear()
  corpora.TextReader().report()  # Nothing odd read: nothing to say.
  assert not caplog.records


def test_corpus_files_and_splits(tmp_path):
  _write(tmp_path, [f'm{i}.py' for i in range(30)] + ['skip.txt'])
  cfg = ml_collections.ConfigDict(
      {'corpus': str(tmp_path), 'extensions': ('.py',), 'valid_fraction': 0.2})
  files = corpora.corpus_files(cfg)
  assert len(files) == 30
  splits = corpora.corpus_splits(cfg)
  assert sorted(splits['train'] + splits['valid']) == files
  assert splits['valid']
  cfg.corpus = 'stdlib'
  assert corpora.corpus_files(cfg) == corpora.stdlib_files()
  cfg.corpus = str(tmp_path / 'missing')
  with pytest.raises(ValueError, match='missing'):
    corpora.corpus_files(cfg)


def test_heldout_files():
  files = corpora.heldout_files()
  assert files and all(f.suffix == '.py' for f in files)
  stdlib = set(corpora.stdlib_files())
  assert not stdlib & set(files)
  with pytest.raises(ValueError, match='installed'):
    corpora.heldout_files(('no_such_package_xyz',))


def test_corpus_sources_parses_mixes():
  assert corpora.corpus_sources('stdlib') == ['stdlib']
  assert corpora.corpus_sources('stdlib + stdlib_prose') == ['stdlib', 'stdlib_prose']
  with pytest.raises(ValueError, match='empty source'):
    corpora.corpus_sources('stdlib+')
  with pytest.raises(ValueError, match='twice'):
    corpora.corpus_sources('stdlib+stdlib')


def test_a_mix_splits_each_source_as_it_splits_alone(tmp_path):
  _write(tmp_path / 'a', [f'm{i}.py' for i in range(20)])
  _write(tmp_path / 'b', [f'n{i}.py' for i in range(10)])
  cfg = ml_collections.ConfigDict({'corpus': f'{tmp_path / "a"}+{tmp_path / "b"}',
                                   'extensions': ('.py',), 'valid_fraction': 0.3})
  alone = {}
  for name in 'ab':
    alone[name] = corpora.corpus_splits(ml_collections.ConfigDict(
        {'corpus': str(tmp_path / name), 'extensions': ('.py',), 'valid_fraction': 0.3}))
  mixed = corpora.corpus_splits(cfg)
  for split in ('train', 'valid'):
    assert mixed[split] == alone['a'][split] + alone['b'][split]
  assert corpora.corpus_files(cfg) == sorted(corpora.corpus_files(cfg)[:20]) + sorted(
      corpora.corpus_files(cfg)[20:])
  assert corpora.corpus_root(cfg) == tmp_path


def test_stdlib_prose_is_built_once_from_topics_and_docstrings(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  modules = [p for p in corpora.stdlib_files() if p.name in ('bisect.py', 'heapq.py')]
  monkeypatch.setattr(corpora, 'stdlib_files', lambda: modules)
  root = corpora.stdlib_prose_root()
  assert root.parent == tmp_path / 'corpora'
  files = corpora.source_files('stdlib_prose', ())
  names = {f.relative_to(root).as_posix() for f in files}
  assert 'docstrings/heapq.txt' in names
  assert any(n.startswith('topics/') for n in names)  # pydoc_data ships with CPython.
  heapq_prose = (root / 'docstrings/heapq.txt').read_text()
  assert 'heap' in heapq_prose and 'def ' not in heapq_prose
  # Built once: a second call reads the same directory, nothing is rebuilt.
  monkeypatch.setattr(corpora, 'stdlib_prose_texts', lambda: pytest.fail('rebuilt'))
  assert corpora.stdlib_prose_root() == root
  assert not [p for p in root.parent.iterdir() if p.name.startswith('.')]  # No staging left.


def test_stdlib_tests_reads_the_test_suite_and_names_a_stripped_one(tmp_path, monkeypatch):
  monkeypatch.setattr(corpora, 'stdlib_root', lambda: tmp_path)
  _write(tmp_path / 'test', ['support/__init__.py', 'regrtest.py'])
  with pytest.raises(ValueError, match='no standard-library test suite'):
    corpora.source_files('stdlib_tests', ())
  _write(tmp_path / 'test', [f'test_m{i}.py' for i in range(120)] + ['data/x.txt'])
  files = corpora.source_files('stdlib_tests', ('.txt',))  # Always the suite's .py files.
  assert len(files) == 122 and all(f.suffix == '.py' for f in files)
  assert corpora.source_root('stdlib_tests') == tmp_path / 'test'


def test_copy_corpus_copies_each_source_with_its_files_and_split(tmp_path):
  _write(tmp_path / 'a', [f'pkg/m{i}.py' for i in range(20)] + ['notes.md'])
  _write(tmp_path / 'b', [f'n{i}.py' for i in range(10)])
  original = ml_collections.ConfigDict({'corpus': f'{tmp_path / "a"}+{tmp_path / "b"}',
                                        'extensions': ('.py',), 'valid_fraction': 0.3})
  copied = original.copy_and_resolve_references()
  copied.corpus = corpora.copy_corpus(original.corpus, original.extensions, tmp_path / 'copy')
  assert copied.corpus == f'{tmp_path / "copy" / "0-a"}+{tmp_path / "copy" / "1-b"}'
  assert not (tmp_path / 'copy' / '0-a' / 'notes.md').exists()
  for split in ('train', 'valid'):
    before = [f.relative_to(tmp_path).parts[1:] for f in corpora.corpus_splits(original)[split]]
    after = [f.relative_to(tmp_path / 'copy').parts[1:]
             for f in corpora.corpus_splits(copied)[split]]
    assert before == after and before
  for copy in corpora.source_files(str(tmp_path / 'copy' / '0-a'), ('.py',)):
    source = tmp_path / 'a' / copy.relative_to(tmp_path / 'copy' / '0-a')
    assert copy.read_text() == source.read_text()
