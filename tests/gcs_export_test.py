"""Export and weight import on Cloud Storage: a gs:// workdir exported to gs:// in every format,
loaded back from the bucket, and an hf export imported from the bucket into a gs:// workdir,
against the local emulator (`gcs_bucket`, conftest.py) through the real clients."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import uuid

import jax
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from etils import epath
from flax import nnx

import mtp
from launch import export as export_cli
from mtp.checkpoint import paths
from mtp.export import ExportError
from mtp.export import manifest as manifest_lib
from mtp.export import runtime
from mtp.export import writer

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ['def add(a, b):\n    return', 'import os\n']
M = 8  # Tokens generated per prompt.


def _files(url: str) -> set[str]:
  """Every object under `url`, relative to it."""
  return {relative for _, relative in paths.list_files(url)}


@pytest.fixture(scope='module')
def bucket(gcs_emulator):
  """A directory on the local Cloud Storage for this module's shared exports (gcs_bucket is
  per test; exporting every format once for the module keeps it quick)."""
  import gcsfs  # pylint: disable=import-outside-toplevel
  del gcs_emulator
  # As gcs_bucket: clients made before the emulator's variables were set would reach the real
  # service.
  gcsfs.GCSFileSystem.clear_instance_cache()
  epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  return f'gs://bucket/gcs-export-{uuid.uuid4().hex[:8]}'


@pytest.fixture(scope='module')
def workdir(tiny_workdir, bucket):
  """The session's tiny workdir, copied to the bucket file by file (its Orbax checkpoint
  included, as written locally)."""
  url = f'{bucket}/workdir'
  local = pathlib.Path(tiny_workdir)
  for file in sorted(p for p in local.rglob('*') if p.is_file()):
    paths.copy_file(file, f'{url}/{file.relative_to(local).as_posix()}')
  return url


@pytest.fixture(scope='module')
def local_tokens(tiny_workdir):
  """Greedy tokens of the local workdir, both decoders."""
  source = mtp.load(tiny_workdir)
  return {decoder: [g.tokens for g in mtp.generate(source, PROMPTS, max_new_tokens=M,
                                                   decoder=decoder)]
          for decoder in ('autoregressive', 'speculative')}


def _staging_left(output: str) -> list[str]:
  """The local staging directories of exports to `output` (writer.py) still on this host."""
  name = output.rsplit('/', 1)[1]
  return sorted(str(p) for p in paths.staging_parent(output).glob(f'.{name}.exporting-*'))


def test_params_export_on_the_bucket_decodes_as_the_local_workdir(workdir, bucket, tiny_workdir,
                                                                  local_tokens):
  output = f'{bucket}/params'
  summary = writer.export(workdir, 'params', output)
  assert summary['output'] == output  # Not folded into a local path, nor made "absolute".
  record = manifest_lib.read(output)
  assert record['source'] == {'workdir': workdir, 'step': 2} and record['format'] == 'params'
  files = _files(output)
  assert {'export.json', 'config.json', 'tokenizer.json'} <= files
  assert any(f.startswith('checkpoints/2/params/') for f in files), files
  # Sizes measured on the bucket too: the parameters against the training checkpoint there.
  details = summary['params']
  assert 0 < details['checkpoint_bytes'] < 0.5 * details['training_checkpoint_bytes']
  assert not _staging_left(output)
  loaded = mtp.load(output)
  assert str(loaded.workdir) == output and loaded.step == 2
  for decoder, want in local_tokens.items():
    got = mtp.generate(loaded, PROMPTS, max_new_tokens=M, decoder=decoder)
    assert [g.tokens for g in got] == want, decoder


def test_jax_export_on_the_bucket_runs_and_matches(workdir, bucket, local_tokens):
  output = f'{bucket}/artifact'
  writer.export(workdir, 'jax_export', output, max_new_tokens=M, platforms=['cpu'])
  assert {'export.json', 'params.safetensors', 'tokenizer.json', 'config.json'} <= _files(output)
  artifact = mtp.load(output)
  assert isinstance(artifact, runtime.LoadedArtifact) and str(artifact.workdir) == output
  for decoder, want in local_tokens.items():
    got = mtp.generate(artifact, PROMPTS, max_new_tokens=M, decoder=decoder)
    assert [g.tokens for g in got] == want, decoder


def test_hf_export_on_the_bucket_imports_into_a_workdir_on_the_bucket(workdir, bucket,
                                                                      tiny_workdir):
  """The export, then launch.import_weights from the bucket to the bucket (a process of its
  own: one entry point's flags per test module)."""
  output, imported = f'{bucket}/hf', f'{bucket}/imported'
  writer.export(workdir, 'hf', output)
  assert {'export.json', 'config.json', 'model.safetensors', 'tokenizer.json'} <= _files(output)
  run = subprocess.run([sys.executable, '-m', 'launch.import_weights', f'--source={output}',
                        f'--workdir={imported}'], env=dict(os.environ, JAX_PLATFORMS='cpu'),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'Imported {output} into {imported}' in run.stderr
  assert {'config.json', 'tokenizer.json'} <= _files(imported)
  config = json.loads(epath.Path(f'{imported}/config.json').read_text())
  assert config['pretrained']['path'] == output and config['pretrained']['format'] == 'hf'
  assert {f['name'] for f in config['pretrained']['files']} >= {'config.json',
                                                                'model.safetensors'}
  source, back = mtp.load(tiny_workdir), mtp.load(imported)
  assert back.model.cfg == source.model.cfg
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(source.model)),
               nnx.to_pure_dict(nnx.state(back.model)))
  assert back.tokenizer.to_json() == source.tokenizer.to_json()
  assert not list((paths.host_cache_root() / 'importing').glob('*/*'))


def test_a_failed_upload_leaves_nothing_and_export_json_goes_last(workdir, gcs_bucket,
                                                                  monkeypatch):
  output = f'{gcs_bucket}/params'
  copied = []
  copy_file = paths.copy_file

  def failing(source, target):
    if len(copied) == 3:
      raise OSError('connection reset (injected)')
    copied.append(os.fspath(target))
    copy_file(source, target)

  monkeypatch.setattr(paths, 'copy_file', failing)
  with pytest.raises(OSError, match='injected'):
    writer.export(workdir, 'params', output)
  assert len(copied) == 3 and not epath.Path(output).exists()
  assert not _staging_left(output)
  copied.clear()
  monkeypatch.setattr(paths, 'copy_file', lambda s, t: (copied.append(os.fspath(t)),
                                                        copy_file(s, t)))
  writer.export(workdir, 'params', output)
  assert copied[-1] == f'{output}/export.json' and len(copied) == len(_files(output))


_KILLED_MID_UPLOAD = textwrap.dedent('''
    import os, sys
    from mtp.checkpoint import paths
    from mtp.export import writer
    copy_file, copied = paths.copy_file, []
    def dying(source, target):
      if len(copied) == 2:
        os._exit(9)  # As kill -9: no handler, no cleanup.
      copied.append(target)
      copy_file(source, target)
    paths.copy_file = dying
    writer.export(sys.argv[1], 'params', sys.argv[2])
''')


def test_an_export_killed_mid_upload_is_never_taken_for_a_complete_one(workdir, gcs_bucket):
  output = f'{gcs_bucket}/params'
  run = subprocess.run([sys.executable, '-c', _KILLED_MID_UPLOAD, workdir, output],
                       env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
  assert run.returncode == 9, run.stderr[-3000:]
  assert len(_files(output)) == 2 and manifest_lib.read(output) is None
  assert _staging_left(output)  # The dead process's local staging directory.
  with pytest.raises(ExportError, match=r'already exists \(without export.json: an export '
                                        r'stopped while uploading\?\)'):
    writer.export(workdir, 'params', output)
  paths.remove_tree(output)
  writer.export(workdir, 'params', output)  # Takes over the dead pid's lock, clears the staging.
  assert manifest_lib.read(output)['format'] == 'params' and not _staging_left(output)


def _run(argv):
  FLAGS.unparse_flags()
  FLAGS(['export'] + argv)
  export_cli.main(['export'])


@flagsaver.flagsaver
def test_the_command_line_exports_from_and_to_the_bucket(workdir, gcs_bucket, tmp_path, capsys,
                                                         monkeypatch):
  monkeypatch.delenv('MTP_TRACEBACK', raising=False)
  monkeypatch.chdir(tmp_path)  # pathlib would fold gs://b/x into ./gs:/b/x here.
  output = f'{gcs_bucket}/params'
  _run([f'--workdir={workdir}', '--format=params', f'--output={output}', '--dtype=bfloat16'])
  captured = capsys.readouterr()
  summary = json.loads(captured.out)
  assert summary['output'] == output and summary['dtype'] == 'bfloat16'
  assert f'of step 2 in {output}:' in captured.err
  assert manifest_lib.read(output)['dtype'] == 'bfloat16'
  with pytest.raises(SystemExit) as exit_info:  # Once there, never written over.
    _run([f'--workdir={workdir}', '--format=params', f'--output={output}'])
  assert exit_info.value.code == (f'launch.export: output {output} already exists: exports '
                                  'never write over anything; remove it or choose another '
                                  '--output'), exit_info.value.code
  with pytest.raises(SystemExit) as exit_info:
    _run([f'--workdir={gcs_bucket}/nowhere', '--format=params', f'--output={gcs_bucket}/out'])
  assert exit_info.value.code == f'launch.export: workdir {gcs_bucket}/nowhere does not exist'
  assert not list(tmp_path.iterdir())  # No gs: directory here.
  assert not epath.Path(f'{gcs_bucket}/out').exists()


def _upload(local: pathlib.Path, url: str) -> str:
  for file in sorted(p for p in local.rglob('*') if p.is_file()):
    paths.copy_file(file, f'{url}/{file.relative_to(local).as_posix()}')
  return url


def test_sources_on_the_bucket_import_as_local_ones(gcs_bucket, tmp_path):
  """A GGUF file and a sharded Hugging Face directory on the bucket import as their local
  originals do (to a local workdir and to one on the bucket); what the reader does not read
  (PyTorch weights) is not fetched."""
  from mtp.pretrained import testing  # pylint: disable=import-outside-toplevel
  from mtp.pretrained import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  gguf = tmp_path / 'src' / 'tiny.gguf'
  gguf.parent.mkdir()
  testing.write_gguf(gguf, testing.random_tensors(), types={'model.embed_tokens.weight': 'Q8_0'})
  hf = testing.write_hf_directory(tmp_path / 'src' / 'hf', testing.random_tensors(seed=1),
                                  num_shards=2)
  (hf / 'pytorch_model.bin').write_bytes(b'not read')
  _upload(tmp_path / 'src', f'{gcs_bucket}/src')
  for name in ('tiny.gguf', 'hf'):
    want = mtp.load(workdir_lib.import_weights(tmp_path / 'src' / name, tmp_path / name))
    for target in (tmp_path / f'{name}-from-bucket', f'{gcs_bucket}/{name}-workdir'):
      got = mtp.load(workdir_lib.import_weights(f'{gcs_bucket}/src/{name}', target))
      jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(want.model)),
                   nnx.to_pure_dict(nnx.state(got.model)))
      assert got.tokenizer.to_json() == want.tokenizer.to_json()
      assert got.config.pretrained.path == f'{gcs_bucket}/src/{name}'
      assert got.config.pretrained.files == want.config.pretrained.files  # Names, sizes, hashes.
  copies = pathlib.Path(os.fspath(paths.cache_root())) / 'remote' / 'gs' / gcs_bucket[5:]
  assert (copies / 'src' / 'hf' / 'model.safetensors.index.json').is_file()
  assert not (copies / 'src' / 'hf' / 'pytorch_model.bin').exists()
  with pytest.raises(workdir_lib.PretrainedError, match=f'{gcs_bucket}/none does not exist'):
    workdir_lib.import_weights(f'{gcs_bucket}/none', tmp_path / 'none')
  assert not (tmp_path / 'none').exists()
