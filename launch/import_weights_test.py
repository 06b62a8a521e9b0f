"""launch.import_weights on tiny synthetic sources."""

import pytest
from absl import flags
from absl.testing import flagsaver

import mtp
from launch import import_weights
from mtp.checkpoint import workdir_lock
from mtp.pretrained import testing

FLAGS = flags.FLAGS


def _run(argv):
  FLAGS.unparse_flags()
  FLAGS(['import_weights'] + argv)
  import_weights.main(['import_weights'])


@flagsaver.flagsaver
def test_imports_a_gguf_file(tmp_path, capsys):
  source = tmp_path / 'tiny.gguf'
  testing.write_gguf(source, testing.random_tensors(), types={
      'model.embed_tokens.weight': 'Q8_0', 'model.layers.1.mlp.up_proj.weight': 'Q4_1'})
  _run([f'--source={source}', f'--workdir={tmp_path / "w"}'])
  assert '2 layers, width 64' in capsys.readouterr().err
  loaded = mtp.load(tmp_path / 'w')
  assert loaded.model.cfg.trunk.num_layers == 2 and loaded.tokenizer.eos_id == 2


@flagsaver.flagsaver
def test_errors_name_the_problem_and_write_nothing(tmp_path):
  testing.write_hf_directory(tmp_path / 'hf', testing.random_tensors(),
                             config={'rope_scaling': {'type': 'linear', 'factor': 2.0}})
  with pytest.raises(SystemExit, match="rope scaling 'linear' is not supported"):
    _run([f'--source={tmp_path / "hf"}', f'--workdir={tmp_path / "w"}'])
  assert not (tmp_path / 'w').exists()
  with pytest.raises(SystemExit, match='does not exist'):
    _run([f'--source={tmp_path / "nothing.gguf"}', f'--workdir={tmp_path / "w"}'])


@flagsaver.flagsaver
def test_a_workdir_another_process_holds_is_refused(tmp_path):
  source = tmp_path / 'tiny.gguf'
  testing.write_gguf(source, testing.random_tensors())
  with workdir_lock.WorkdirLock(tmp_path / 'w'):
    with pytest.raises(SystemExit, match=r'launch.import_weights: .*w is in use by pid \d+'):
      _run([f'--source={source}', f'--workdir={tmp_path / "w"}'])
  assert not (tmp_path / 'w').exists()
