"""launch.export: the formats from the command line, and one line for every bad input."""

import json
import os
import re
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from launch import export

FLAGS = flags.FLAGS


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  return tiny_workdir


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _run(argv):
  FLAGS.unparse_flags()
  FLAGS(['export'] + argv)
  export.main(['export'])


@flagsaver.flagsaver
def test_params_and_jax_export(workdir, tmp_path, capsys):
  _run([f'--workdir={workdir}', '--format=params', f'--output={tmp_path / "params"}',
        '--dtype=bfloat16'])
  captured = capsys.readouterr()
  summary = json.loads(captured.out)
  assert summary['format'] == 'params' and summary['dtype'] == 'bfloat16'
  assert re.search(r'its checkpoint [\d.]+ MB, the training checkpoint\'s [\d.]+ MB\)',
                   captured.err)
  assert json.loads((tmp_path / 'params' / 'export.json').read_text())['step'] == 2
  _run([f'--workdir={workdir}', '--format=jax_export', f'--output={tmp_path / "artifact"}',
        '--max_new_tokens=8', '--tree=[[0], [1], [0, 0]]', '--platforms=cpu'])
  captured = capsys.readouterr()
  artifact = json.loads(captured.out)['jax_export']
  assert artifact['max_new_tokens'] == 8 and artifact['platforms'] == ['cpu']
  [speculative] = [p for p in artifact['programs'] if p['decoder'] == 'speculative']
  assert speculative['tree'] == [[0], [1], [0, 0]]
  assert re.match(r'launch.export: jax_export \(float32\) of step 2 in .*artifact: [\d.]+ MB',
                  captured.err.splitlines()[-1])
  ordinary = 0o666 & ~_umask()  # Weights (params.safetensors) as every other file.
  modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for p in sorted(tmp_path.rglob('*')) if p.is_file()}
  assert 'artifact/params.safetensors' in modes
  assert set(modes.values()) == {oct(ordinary)}, modes


@pytest.mark.parametrize('argv,message', [
    (['--format=onnx'], "unknown export format 'onnx'"),
    (['--format=params', '--dtype=float16'], "cannot hold dtype 'float16'"),
    (['--format=params', '--max_new_tokens=8'], 'max_new_tokens does not apply'),
    (['--format=jax_export', '--tree=bushy'], 'tree must be one of chain, default'),
    (['--format=jax_export', '--tree=auto'], "tree='auto' is measured at run time"),
    (['--format=jax_export', '--lookup=-1'], 'cannot export the speculative decoder: lookup'),
    (['--format=params', '--output={tmp}/taken'], 'output .*taken already exists'),
    (['--format=params', '--workdir={tmp}/nowhere'], 'workdir .*nowhere does not exist'),
    (['--format=params', '--workdir={tmp}'], 'is not an mtp workdir'),
])
@flagsaver.flagsaver
def test_bad_input_is_one_line_and_leaves_nothing(workdir, tmp_path, capsys, monkeypatch, argv,
                                                  message):
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  (tmp_path / 'taken').mkdir()
  argv = [f'--workdir={workdir}', f'--output={tmp_path / "out"}'] + [
      a.format(tmp=tmp_path) for a in argv]
  with pytest.raises(SystemExit) as exit_info:
    _run(argv)
  assert isinstance(exit_info.value.code, str)  # absl prints it to stderr and exits with 1.
  assert re.match(f'launch.export: .*{message}', exit_info.value.code), exit_info.value.code
  assert '\n' not in exit_info.value.code and 'Traceback' not in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ['taken']


def test_the_command_line_fails_with_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('MTP_TRACEBACK', None)
  run = subprocess.run([sys.executable, '-m', 'launch.export', f'--workdir={tmp_path}/none',
                        '--format=params', f'--output={tmp_path}/out'], env=env,
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert run.returncode == 1
  assert run.stderr.strip().splitlines() == [
      f'launch.export: workdir {tmp_path}/none does not exist'], run.stderr
  run = subprocess.run([sys.executable, '-m', 'launch.export', '--format=params',
                        f'--workdir={tmp_path}'], env=env,
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert run.returncode == 2 and run.stderr.strip().splitlines() == [
      'launch.export: flag --output=None: Flag --output must have a value other than None.']


@flagsaver.flagsaver
def test_an_output_under_a_file_is_named_in_one_line(workdir, tmp_path, monkeypatch):
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  (tmp_path / 'somefile').write_text('keep me')
  with pytest.raises(SystemExit) as exit_info:
    _run([f'--workdir={workdir}', '--format=params', f'--output={tmp_path}/somefile/out'])
  message = exit_info.value.code
  assert message == (f'launch.export: cannot create output {tmp_path}/somefile/out: '
                     f'{tmp_path}/somefile is a file, not a directory'), message
  assert (tmp_path / 'somefile').read_text() == 'keep me'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['somefile']


@pytest.mark.parametrize('flag', ['output', 'workdir'])
@flagsaver.flagsaver
def test_a_url_is_never_folded_into_a_local_path(workdir, tmp_path, monkeypatch, capsys,
                                                 gcs_bucket, flag):
  """gs:// paths reach Cloud Storage (here the local emulator): an export from a local
  workdir lands on the bucket; a workdir missing there is named as the URL it is."""
  from mtp.export import manifest  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  monkeypatch.chdir(tmp_path)  # pathlib would fold gs://b/x into ./gs:/b/x here.
  url = f'{gcs_bucket}/x'
  argv = {'workdir': str(workdir), 'output': 'out', flag: url}
  if flag == 'output':
    _run(['--format=params', *(f'--{k}={v}' for k, v in argv.items())])
    assert json.loads(capsys.readouterr().out)['output'] == url
    assert manifest.read(url)['format'] == 'params'
  else:
    with pytest.raises(SystemExit) as exit_info:
      _run(['--format=params', *(f'--{k}={v}' for k, v in argv.items())])
    assert exit_info.value.code == f'launch.export: workdir {url} does not exist'
  assert not list(tmp_path.iterdir())  # No gs: directory, no out.
