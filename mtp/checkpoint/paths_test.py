"""paths: local paths, and URLs refused by name where only local files are handled."""

import pathlib

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
