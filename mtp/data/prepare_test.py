"""Tests for mtp.data.prepare: datasets from a directory, JSONL and Parquet; manifest; failures."""

import json
import logging
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from mtp.checkpoint import workdir_lock
from mtp.data import corpora
from mtp.data import prepare
from mtp.data import shards
from mtp.data import sources
from mtp.data import tokenizer as tokenizer_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def code_dir(tmp_path):
  root = tmp_path / 'code'
  (root / 'pkg').mkdir(parents=True)
  for i in range(24):
    (root / 'pkg' / f'm{i:02d}.py').write_text(f'def f{i}(x):\n  return x * {i}  # é\n' * (i % 4))
  (root / 'blob.py').write_bytes(b'\x00\x01binary')
  return root


def _documents(directory, split):
  return shards.open_dataset(directory).split(split).documents()


def test_a_directory_dataset_holds_each_file_tokenized(code_dir, tmp_path):
  out = tmp_path / 'ds'
  result = prepare.prepare(str(code_dir), out, valid_fraction=0.2, num_workers=1,
                           shard_tokens=200, record_tokens=32)
  tok = tokenizer_lib.byte_tokenizer()
  files = [p for p in corpora.list_files(code_dir, ['.py']) if p.name != 'blob.py']
  train, valid = corpora.split_files(corpora.list_files(code_dir, ['.py']), 0.2, code_dir)
  for split, paths in (('train', train), ('valid', valid)):
    want = [np.append(tok.encode_arrays([p.read_text()])[0], tok.eos_id)
            for p in paths if p.name != 'blob.py']
    got = _documents(out, split)
    assert len(got) == len(want) and want
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
  manifest = json.loads((out / shards.MANIFEST_FILENAME).read_text())
  assert manifest == {k: v for k, v in result.items() if k != 'stats'}
  assert manifest['tokenizer'] == {
      'kind': 'byte', 'vocab_size': 259, 'sha256': shards.tokenizer_hash(tok),
      'special_ids': {'pad_id': 0, 'eos_id': 1, 'bos_id': 2}, 'file': 'tokenizer.json',
      'from': 'byte'}
  assert manifest['skipped'] == {'binary_files': 1}
  assert manifest['token_dtype'] == 'uint16' and manifest['record_tokens'] == 32
  train_entry = manifest['splits']['train']
  assert len(train_entry['shards']) > 1
  assert train_entry['num_tokens'] == sum(s['num_tokens'] for s in train_entry['shards'])
  assert manifest['num_documents'] == len(files)
  assert manifest['num_tokens'] == sum(len(d) for s in shards.SPLITS
                                       for d in _documents(out, s))
  assert tokenizer_lib.Tokenizer.load(out).to_json() == tok.to_json()
  assert not list(tmp_path.glob('.ds*'))  # No staging left.


def test_workers_write_the_same_dataset(tmp_path):
  path = tmp_path / 'c.jsonl'
  path.write_text(''.join(json.dumps({'text': f'record {i} ' * (i % 7)}) + '\n'
                          for i in range(600)))
  one = prepare.prepare(str(path), tmp_path / 'one', num_workers=1)
  two = prepare.prepare(str(path), tmp_path / 'two', num_workers=2)
  assert one['splits'] == two['splits'] and two['stats']['num_workers'] == 2
  for split in shards.SPLITS:
    for a, b in zip(_documents(tmp_path / 'one', split), _documents(tmp_path / 'two', split),
                    strict=True):
      np.testing.assert_array_equal(a, b)


def test_bpe_and_a_reused_tokenizer(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  texts = [f'def function_{i}(value):\n    return value + {i}\n' for i in range(300)]
  pq.write_table(pa.table({'body': texts}), tmp_path / 'd.parquet', row_group_size=64)
  first = prepare.prepare(str(tmp_path / 'd.parquet'), tmp_path / 'a', tokenizer='bpe',
                          vocab_size=300, text_field='body', num_workers=1)
  tok = tokenizer_lib.Tokenizer.load(tmp_path / 'a')
  assert first['tokenizer']['kind'] == 'bpe' and 259 < tok.vocab_size <= 300
  docs = _documents(tmp_path / 'a', 'train') + _documents(tmp_path / 'a', 'valid')
  assert sorted(tok.decode(d) for d in docs) == sorted(texts)
  assert sum(len(d) for d in docs) < sum(len(t) for t in texts)  # Merges were learned.
  again = prepare.prepare(str(tmp_path / 'd.parquet'), tmp_path / 'b', tokenizer=str(
      tmp_path / 'a'), text_field='body', num_workers=1)
  assert again['tokenizer']['sha256'] == first['tokenizer']['sha256']


def test_bad_arguments_write_nothing(code_dir, tmp_path):
  out = tmp_path / 'ds'
  with pytest.raises(prepare.PrepareError, match="'byte', 'bpe' or a directory"):
    prepare.prepare(str(code_dir), out, tokenizer=str(tmp_path / 'none'))
  with pytest.raises(sources.SourceError, match='does not exist'):
    prepare.prepare(str(tmp_path / 'missing'), out)
  with pytest.raises(prepare.PrepareError, match='valid_fraction'):
    prepare.prepare(str(code_dir), out, valid_fraction=1.5)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "fine"}\n' * 50 + '{"text": "cut off\n')
  with pytest.raises(sources.SourceError, match='bad.jsonl:51: not valid JSON'):
    prepare.prepare(str(bad), out, num_workers=1)
  assert not out.exists() and not list(tmp_path.glob('.ds*'))  # Failed midway: nothing left.
  prepare.prepare(str(code_dir), out, num_workers=1)
  with pytest.raises(prepare.PrepareError, match='already exists'):
    prepare.prepare(str(code_dir), out, num_workers=1)
  (tmp_path / f'.ds{prepare.STAGING_MARK}12345').mkdir()  # A killed run's leftovers.
  replaced = prepare.prepare(str(code_dir), out, valid_fraction=0.0, num_workers=1,
                             overwrite=True)
  assert replaced['splits']['valid']['num_documents'] == 0
  assert shards.open_dataset(out).manifest['valid_fraction'] == 0.0
  assert sorted(p.name for p in tmp_path.iterdir()) == ['bad.jsonl', 'code', 'ds']


def test_a_second_run_on_the_same_output_is_refused_and_leaves_the_first_alone(code_dir,
                                                                                tmp_path):
  out = tmp_path / 'ds'
  live = tmp_path / f'.ds{prepare.STAGING_MARK}1'  # The first run's staging (pid 1, say).
  with workdir_lock.WorkdirLock(out):  # As the first run holds it.
    live.mkdir()
    with pytest.raises(workdir_lock.WorkdirLockedError, match=f'is in use by pid {os.getpid()}'):
      prepare.prepare(str(code_dir), out, num_workers=1)
    assert live.is_dir() and not out.exists()
    live.rmdir()
  prepare.prepare(str(code_dir), out, num_workers=1)  # Free again: it runs.
  assert sorted(p.name for p in tmp_path.iterdir()) == ['code', 'ds']


def test_a_worker_that_fails_at_start_ends_the_run_with_one_line(tmp_path):
  """Workers load the tokenizer from the staging directory: without one, each fails at start.
  The run ends with one error, not respawned workers forever."""
  path = tmp_path / 'c.jsonl'
  path.write_text(''.join(json.dumps({'text': f'record {i}'}) + '\n' for i in range(50)))
  script = ('import collections, sys; from mtp.data import prepare, sources; '
            f'corpus = sources.open_source({str(path)!r}); '
            'list(prepare._tokenized(corpus, 0.0, sys.argv[1], 2, collections.Counter()))')
  run = subprocess.Popen([sys.executable, '-c', script, str(tmp_path / 'no_tokenizer')],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=_REPO)
  try:
    _, err = run.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    os.killpg(run.pid, signal.SIGKILL)  # The workers too.
    _, err = run.communicate()
    pytest.fail(f'the run did not end; it printed {len(err.splitlines())} lines')
  assert run.returncode != 0
  assert err.count('Traceback') <= 1, err  # The parent's; no worker's.
  assert re.search(r'PrepareError: a tokenizing worker failed to start: .*no_tokenizer',
                   err.strip().splitlines()[-1]), err


def test_files_the_extension_filter_skips_and_an_empty_valid_split_are_named(tmp_path,
                                                                               caplog):
  root = tmp_path / 'docs'
  root.mkdir()
  (root / 'only.py').write_text('print(1)\n')
  for name in ('a.md', 'b.txt', 'c.rst'):
    (root / name).write_text('prose\n')
  with caplog.at_level(logging.WARNING):
    result = prepare.prepare(str(root), tmp_path / 'ds', num_workers=1, valid_fraction=0.1)
  assert result['splits']['valid']['num_documents'] == 0
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any('3 files' in w and '--extensions' in w and "['.py']" in w for w in warnings), warnings
  assert any('validation split is empty' in w and 'eval_steps=0' in w for w in warnings), warnings
  assert result['skipped'] == {'other_extensions': 3}
