"""paths: local paths, gs:// URLs where they are served, and other URLs refused by name.
(Reads and writes on a bucket: tests/gcs_test.py, tests/remote_workdir_test.py.)"""

import os
import pathlib
import sys

import pytest

from mtp.checkpoint import paths


@pytest.mark.parametrize('path', ['data/ds', '/abs/ds', 'gs:dir', 'a/b://c', '~/ds', '1x://y'])
def test_local_path_keeps_a_local_path(path):
  assert paths.local_path(path, '--output') == pathlib.Path(path)
  assert paths.local_path(pathlib.Path('rel/x'), '--output') == pathlib.Path('rel/x')


@pytest.mark.parametrize('path,scheme', [('gs://b/shards', 'gs'), ('s3://b/x', 's3'),
                                         ('HTTPS://host/x', 'HTTPS'), ('git+ssh://h/r', 'git+ssh')])
def test_local_path_refuses_a_url_by_name(path, scheme):
  with pytest.raises(ValueError) as error:
    paths.local_path(path, '--output')
  assert str(error.value) == (f'--output={path}: {scheme}:// paths are not supported here yet; '
                              'use a local path')


@pytest.mark.parametrize('path', ['data/ds', '/abs/ds', 'gs:dir'])
def test_path_or_url_makes_a_local_path_absolute(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(paths.path_or_url(path, '--output')) == os.path.abspath(path)


def test_path_or_url_keeps_a_gs_url_and_names_what_it_cannot_serve(monkeypatch):
  assert str(paths.path_or_url('gs://b/x', '--output')) == 'gs://b/x'
  with pytest.raises(ValueError) as error:
    paths.path_or_url('s3://b/x', '--output')
  assert str(error.value) == ('--output=s3://b/x: s3:// paths are not supported (use a local '
                              'path or gs://)')
  monkeypatch.setitem(sys.modules, 'gcsfs', None)  # Not installed.
  with pytest.raises(ValueError) as error:
    paths.path_or_url('gs://b/x', 'config.data.source')
  assert str(error.value) == ("config.data.source=gs://b/x: gs:// paths need gcsfs (pip install "
                              "'.[gcs]')")


def test_upload_tree_copies_every_file_and_its_marks_last(tmp_path, monkeypatch):
  source = tmp_path / 'source'
  for name in ('b/x.bin', 'manifest.json', 'a.txt'):
    (source / name).parent.mkdir(parents=True, exist_ok=True)
    (source / name).write_text(name)
  copied = []
  copy_file = paths.copy_file
  monkeypatch.setattr(paths, 'copy_file', lambda s, t: (copied.append(os.path.relpath(
      t, tmp_path / 'target')), copy_file(s, t)))
  assert paths.upload_tree(source, tmp_path / 'target', last=('manifest.json',)) == 3
  assert copied == ['a.txt', 'b/x.bin', 'manifest.json']
  assert (tmp_path / 'target' / 'b' / 'x.bin').read_text() == 'b/x.bin'
  with pytest.raises(FileNotFoundError, match='lacks done.json'):
    paths.upload_tree(source, tmp_path / 'other', last=('done.json',))
  assert not (tmp_path / 'other').exists()


def test_local_copy_of_a_local_path_is_the_path(tmp_path):
  assert paths.local_copy(tmp_path / 'x.npy') == tmp_path / 'x.npy'


def test_a_bucket_cache_root_keeps_host_caches_on_this_host(tmp_path, monkeypatch):
  """MTP_CACHE_DIR may name a bucket (shared measurements); what must be on local disk goes
  under ~/.cache/mtp then."""
  monkeypatch.setenv('HOME', str(tmp_path))
  monkeypatch.setenv('MTP_CACHE_DIR', 'gs://b/cache')
  assert str(paths.cache_root()) == 'gs://b/cache'
  assert paths.host_cache_root() == tmp_path / '.cache' / 'mtp'
  assert str(paths.local_dir('gs://b/run', 'data_cache')) == str(
      tmp_path / '.cache' / 'mtp' / 'workdirs' / 'gs' / 'b' / 'run' / 'data_cache')
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'c'))
  assert str(paths.cache_root()) == str(tmp_path / 'c')
  assert paths.host_cache_root() == tmp_path / 'c'
