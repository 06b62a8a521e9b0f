"""--format=params: a param-only checkpoint that decodes exactly as its workdir, anywhere."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp import testing as mtp_testing
from mtp.checkpoint import fingerprint
from mtp.export import writer
from mtp.train import testing
from mtp.train import trainer as trainer_lib

PROMPTS = ['def add(a, b):\n    return', 'import os\n', 'class Point:\n    def __init__(self']


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  """The session's tiny workdir: exporting it, and training heads on it, only read it."""
  return tiny_workdir


@pytest.fixture(scope='module')
def exported(workdir, tmp_path_factory):
  output = tmp_path_factory.mktemp('exports') / 'params'
  return output, writer.export(workdir, 'params', output)


def _arrays(loaded):
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(loaded.model))[0]
  arrays = {fingerprint.path_name(path): np.asarray(x) for path, x in flat}
  assert len(arrays) == len(flat) > 10
  return arrays


def test_layout_sizes_and_parameters(workdir, exported):
  output, summary = exported
  assert (output / 'config.json').is_file() and (output / 'tokenizer.json').is_file()
  step_dir = output / 'checkpoints' / str(summary['step'])
  assert (step_dir / 'params').is_dir()
  assert not (step_dir / 'opt_state').exists() and not (step_dir / 'data').exists()
  manifest = json.loads((output / 'export.json').read_text())
  assert manifest['format'] == 'params' and manifest['source']['workdir'] == str(workdir)
  sizes = summary['params']
  # Parameters alone: about a third of a training checkpoint (Adam keeps two moments).
  assert sizes['checkpoint_bytes'] < 0.5 * sizes['training_checkpoint_bytes']
  source, loaded = mtp.load(workdir), mtp.load(output)
  assert loaded.step == source.step and loaded.tokenizer.to_json() == source.tokenizer.to_json()
  want, got = _arrays(source), _arrays(loaded)
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_decodes_token_for_token_like_its_workdir(workdir, exported):
  output, _ = exported
  source, loaded = mtp.load(workdir), mtp.load(output)
  for decoder in ('autoregressive', 'speculative'):
    want = mtp.generate(source, PROMPTS, max_new_tokens=12, decoder=decoder)
    got = mtp.generate(loaded, PROMPTS, max_new_tokens=12, decoder=decoder)
    assert [g.tokens for g in got] == [g.tokens for g in want], decoder
    assert [g.num_steps for g in got] == [g.num_steps for g in want], decoder


def test_bfloat16_loads_in_bfloat16_and_decodes_exactly(workdir, tmp_path):
  output = tmp_path / 'bf16'
  summary = writer.export(workdir, 'params', output, dtype='bfloat16')
  assert summary['dtype'] == 'bfloat16'
  loaded = mtp.load(output)
  assert loaded.config.model.param_dtype == 'bfloat16'
  source = _arrays(mtp.load(workdir))
  for name, value in _arrays(loaded).items():
    assert value.dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(value, source[name].astype(ml_dtypes.bfloat16), err_msg=name)
  ar = mtp.generate(loaded, PROMPTS, max_new_tokens=12, decoder='autoregressive')
  spec = mtp.generate(loaded, PROMPTS, max_new_tokens=12, decoder='speculative')
  assert [g.tokens for g in spec] == [g.tokens for g in ar]


def test_heads_on_a_frozen_base_are_merged(workdir, tmp_path):
  heads = tmp_path / 'heads'
  config = testing.tiny_config(**{'init_from': str(workdir), 'optim.mode': 'frozen_trunk',
                                  'model.mtp_head_type': 'parallel', 'model.mtp_num_heads': 2,
                                  'num_train_steps': 1, 'eval_steps': 0})
  trainer_lib.train_and_evaluate(config, heads)
  assert (heads / 'base.json').is_file()
  output = tmp_path / 'merged'
  writer.export(heads, 'params', output)
  assert not (output / 'base.json').exists()
  assert json.loads((output / 'config.json').read_text())['init_from'] == ''
  want, got = _arrays(mtp.load(heads)), _arrays(mtp.load(output))
  assert want.keys() == got.keys() and any(k.startswith('heads') for k in got)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


_ON_8_DEVICES = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    import mtp
    from flax import nnx
    from mtp.checkpoint import checkpointing
    from mtp.model import mtp_model
    from mtp.parallel import mesh as mesh_lib
    export_dir, expected = sys.argv[1], json.loads(sys.argv[2])
    assert jax.device_count() == 8, jax.devices()
    # Onto a mesh of all 8 devices (FSDP x tensor), as a server would shard it.
    loaded = mtp.load(export_dir)
    mesh = mesh_lib.make_mesh({'data': 1, 'fsdp': 4, 'tensor': 2})
    abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(loaded.model.cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract)
    target = checkpointing.abstract_with_shardings(params, mesh_lib.state_shardings(params, mesh))
    sharded, _ = checkpointing.restore_params(export_dir, target)
    spread = {d for x in jax.tree.leaves(sharded) for d in x.sharding.device_set}
    assert len(spread) == 8, spread
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded),
                 jax.device_get(nnx.state(loaded.model)))
    out = mtp.generate(loaded, expected['prompts'], max_new_tokens=12)
    assert [g.tokens for g in out] == expected['tokens'], ([g.tokens for g in out], expected)
    print('ok')
''')


def test_restores_on_another_device_count_and_mesh(workdir, exported):
  """Saved from one device; read by a process with 8 (set before JAX starts there)."""
  output, _ = exported
  tokens = [g.tokens for g in mtp.generate(mtp.load(workdir), PROMPTS, max_new_tokens=12)]
  env = mtp_testing.child_env(devices=8, JAX_PLATFORMS='cpu')
  run = subprocess.run(
      [sys.executable, '-c', _ON_8_DEVICES, str(output),
       json.dumps({'prompts': PROMPTS, 'tokens': tokens})],
      env=env, capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  assert run.returncode == 0 and run.stdout.strip().endswith('ok'), run.stderr[-3000:]
