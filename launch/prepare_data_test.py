"""launch.prepare_data: the command, its output line and its failures."""

import json
import os
import re

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from launch import prepare_data
from mtp.checkpoint import workdir_lock
from mtp.data import shards

FLAGS = flags.FLAGS


def _prepare(*args):
  FLAGS.unparse_flags()
  FLAGS(['prepare_data', *args])
  prepare_data.main(['prepare_data'])


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  lines = [json.dumps({'content': f'def f{i}(x):\n' + '    x += 1\n' * int(rng.integers(0, 30)),
                       'id': i}) for i in range(200)]
  (root / 'code.jsonl').write_text('\n'.join(lines) + '\n')
  return root / 'code.jsonl'


@flagsaver.flagsaver
def test_the_command_prints_its_dataset(corpus, tmp_path, capsys):
  _prepare(f'--source={corpus}', '--text_field=content', '--id_field=id', '--num_workers=1',
           f'--output={tmp_path / "ds"}', '--valid_fraction=0.1')
  printed = json.loads(capsys.readouterr().out)
  manifest = shards.open_dataset(tmp_path / 'ds').manifest
  assert printed['train_num_tokens'] == manifest['splits']['train']['num_tokens'] > 0
  assert printed['valid_num_documents'] == manifest['splits']['valid']['num_documents'] > 0
  assert manifest['source']['id_field'] == 'id'
  with pytest.raises(SystemExit, match=r"launch.prepare_data: .*code.jsonl:1: has no field "
                                       r"'text'"):
    _prepare(f'--source={corpus}', f'--output={tmp_path / "other"}', '--num_workers=1')
  assert not (tmp_path / 'other').exists()


@flagsaver.flagsaver
def test_a_second_run_on_the_same_output_fails_with_one_line(corpus, tmp_path, monkeypatch):
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  output = tmp_path / 'ds'
  with workdir_lock.WorkdirLock(output):  # As a first run on it holds it.
    with pytest.raises(SystemExit) as exit_info:
      _prepare(f'--source={corpus}', '--text_field=content', '--num_workers=1',
               f'--output={output}')
  message = exit_info.value.code
  assert isinstance(message, str) and '\n' not in message  # One line; exit code 1.
  assert re.match(rf'launch.prepare_data: {output} is in use by pid {os.getpid()} .*'
                  rf'{output}.lock', message), message
  assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize('flag,value,expected', [
    ('source', 'gs://b/corpus.jsonl', 'gs:// paths are not supported here yet; use a local path'),
    ('output', 's3://b/x', 's3:// paths are not supported (use a local path or gs://)'),
    ('tokenizer', 's3://b/run', 's3:// paths are not supported (use a local path or gs://)')])
@flagsaver.flagsaver
def test_a_url_it_cannot_use_is_refused_by_name_not_folded_into_a_local_path(
    corpus, tmp_path, monkeypatch, flag, value, expected):
  """A gs:// output or tokenizer is used (tests/gcs_test.py); a gs:// source and other schemes
  are refused, in one line naming the flag."""
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  monkeypatch.chdir(tmp_path)  # pathlib would fold gs://b/x into ./gs:/b/x here.
  argv = {'source': str(corpus), 'output': 'ds', 'tokenizer': 'byte', flag: value}
  with pytest.raises(SystemExit) as exit_info:
    _prepare('--num_workers=1', *(f'--{k}={v}' for k, v in argv.items()))
  message = exit_info.value.code
  assert isinstance(message, str) and '\n' not in message  # One line; exit code 1.
  assert message == f'launch.prepare_data: --{flag}={value}: {expected}', message
  assert sorted(p.name for p in tmp_path.iterdir()) == []  # No gs: directory, no ds.


def test_the_extensions_flag_says_what_it_filters():
  help_text = FLAGS['extensions'].help
  assert 'skipped' in help_text and '.py' in help_text
