"""The export driver: every bad input is named before any work, and nothing is half-written."""

import json
import os
import shutil

import pytest

from mtp.checkpoint import workdir_lock
from mtp.export import ExportError
from mtp.export import params as params_lib
from mtp.export import writer


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  """The session's tiny workdir: exports only read it (the tests that change one copy it)."""
  return tiny_workdir


def _leftovers(parent):
  """Everything an export may leave beside its output: staging siblings, lock files."""
  return sorted(p.name for p in parent.iterdir() if p.name.startswith('.')
                or p.name.endswith('.lock'))


@pytest.mark.parametrize('kwargs,message', [
    (dict(format='onnx'), "unknown export format 'onnx': use one of params, hf, jax_export"),
    (dict(format='params', dtype='float16'), "cannot hold dtype 'float16'"),
    (dict(format='jax_export', dtype='int8'), "cannot hold dtype 'int8'"),
    (dict(format='params', max_new_tokens=8), 'max_new_tokens does not apply to '
     '--format=params'),
    (dict(format='jax_export', max_new_tokens=0), r'max_new_tokens must be an integer in '
     r'\[1, 256\)'),
    (dict(format='jax_export', tree='auto'), "tree='auto' is measured at run time, which an "
     'export cannot do: export the tree it picks as Medusa-style choices'),
    (dict(format='jax_export', tree='dynamic'), "tree='dynamic' is measured at run time"),
    (dict(format='jax_export', tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]),
     'cannot export the speculative decoder: tree depth 4 exceeds'),
    (dict(format='jax_export', platforms=['gpu']), 'platforms must be some of'),
    (dict(format='jax_export', top_p=0.5), 'give a temperature > 0'),
])
def test_bad_options_are_named_and_nothing_is_written(workdir, tmp_path, kwargs, message):
  output = tmp_path / 'out'
  with pytest.raises(ExportError, match=message):
    writer.export(workdir, output=output, **kwargs)
  assert not output.exists() and not _leftovers(tmp_path)


def test_workdirs_without_a_checkpoint_are_named(workdir, tmp_path):
  output = tmp_path / 'out'
  with pytest.raises(ExportError, match='does not exist'):
    writer.export(tmp_path / 'nowhere', 'params', output)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ExportError, match='is not an mtp workdir: it has no config.json'):
    writer.export(tmp_path / 'empty', 'params', output)
  untrained = tmp_path / 'untrained'
  shutil.copytree(workdir, untrained, ignore=shutil.ignore_patterns('checkpoints'))
  with pytest.raises(ExportError, match='holds no checkpoint to export'):
    writer.export(untrained, 'jax_export', output)
  heads = tmp_path / 'heads'  # Heads on a base workdir that has no checkpoint.
  shutil.copytree(workdir, heads)
  (heads / 'base.json').write_text(json.dumps({'base_workdir': '../untrained'}))
  with pytest.raises(ExportError, match=f'{untrained} holds no checkpoint'):
    writer.export(heads, 'params', output)
  assert not output.exists() and _leftovers(tmp_path) == []


def test_an_existing_output_is_never_written_over(workdir, tmp_path):
  (tmp_path / 'dir').mkdir()
  (tmp_path / 'file').write_text('keep me')
  for name, kind in (('dir', 'directory'), ('file', 'file')):
    with pytest.raises(ExportError, match=f'{tmp_path / name} already exists \\(a {kind}\\)'):
      writer.export(workdir, 'params', tmp_path / name)
  assert (tmp_path / 'file').read_text() == 'keep me' and not list((tmp_path / 'dir').iterdir())
  with pytest.raises(ExportError, match='already exists'):
    writer.export(workdir, 'params', workdir)


def test_a_failure_midway_leaves_nothing(workdir, tmp_path, monkeypatch):
  output = tmp_path / 'out'
  real_write = params_lib.write

  def failing_write(loaded, directory, dtype):
    real_write(loaded, directory, dtype)  # The checkpoint and the tokenizer are written ...
    assert (directory / 'checkpoints').is_dir()
    raise RuntimeError('disk full')  # ... then the export fails.
  monkeypatch.setattr(params_lib, 'write', failing_write)
  with pytest.raises(RuntimeError, match='disk full'):
    writer.export(workdir, 'params', output)
  assert not output.exists() and _leftovers(tmp_path) == []
  monkeypatch.undo()
  (tmp_path / '.out.exporting-999999').mkdir()  # As a killed export leaves it.
  summary = writer.export(workdir, 'params', output)  # The same export now succeeds.
  assert summary['format'] == 'params' and (output / 'export.json').is_file()
  assert _leftovers(tmp_path) == []


def test_the_output_lock_keeps_a_second_export_out(workdir, tmp_path):
  output = tmp_path / 'out'
  with workdir_lock.WorkdirLock(output):
    with pytest.raises(workdir_lock.WorkdirLockedError, match='is in use by'):
      writer.export(workdir, 'params', output)
  assert not output.exists() and _leftovers(tmp_path) == []


def test_mtp_load_names_an_export_it_does_not_run(tmp_path):
  import mtp  # pylint: disable=import-outside-toplevel
  (tmp_path / 'export.json').write_text(json.dumps({'format': 'hf'}))
  with pytest.raises(ValueError, match='is an export in the hf format, which mtp does not run'):
    mtp.load(tmp_path)
  (tmp_path / 'export.json').write_text('{"format": ')
  with pytest.raises(ValueError, match='export.json is corrupt: not valid JSON'):
    mtp.load(tmp_path)


def test_every_export_file_has_the_ordinary_mode(workdir, tmp_path):
  """Weights too (safetensors writes them 0600): 0644 under the usual umask, as other files."""
  mask = os.umask(0)
  os.umask(mask)
  writer.export(workdir, 'hf', tmp_path / 'hf')
  modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for p in sorted(tmp_path.rglob('*')) if p.is_file()}
  assert 'hf/model.safetensors' in modes
  assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
