"""Restoring parameters: parts of a tree, checkpoints of another model, and the heads' legacy
parameter names (in the parameters and in the optimizer state)."""

import gc
import importlib
import json
import logging
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from mtp.checkpoint import checkpointing
from mtp.checkpoint import param_tree
from mtp.model import mtp_model
from mtp.train import optim


def _config(head_type='medusa', vocab_size=264):
  config = tiny.get_config()
  config.model.mtp_head_type = head_type
  config.model.vocab_size = vocab_size
  return config


def _params_and_target(config):
  model = mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config.model), rngs=nnx.Rngs(0))
  params = nnx.state(model)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        params)
  return params, target


def _nested(tree) -> dict:
  """`tree` as the nested dicts Orbax saves it as (keys as strings, 'value' leaves and all)."""
  out: dict = {}
  for path, leaf in checkpointing._flat(tree).items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def _with_legacy_heads(tree):
  """The inverse of `upgrade_legacy_tree`: every `heads` node in today's `layers` layout back in
  the old one (medusa: heads/heads/{k}/{j}; parallel: heads/blocks/{k}, heads/norms/{k})."""
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if key == 'heads' and isinstance(value, dict) and 'layers' in value:
      layers = value['layers']
      if all('blocks' in layer for layer in layers.values()):
        out[key] = {'heads': {k: layer['blocks'] for k, layer in layers.items()}}
      else:
        out[key] = {'blocks': {k: layer['block'] for k, layer in layers.items()},
                    'norms': {k: layer['norm'] for k, layer in layers.items()}}
    else:
      out[key] = _with_legacy_heads(value)
  return out


def _arrays(tree) -> dict:
  return {path: np.asarray(leaf) for path, leaf in checkpointing._flat(tree).items()}


@pytest.mark.parametrize('head_type', ['medusa', 'parallel'])
def test_a_checkpoint_with_the_legacy_head_names_restores(tmp_path, head_type):
  if not hasattr(importlib.import_module('mtp.model.heads'), 'upgrade_legacy_tree'):
    pytest.skip('mtp.model.heads.upgrade_legacy_tree does not exist yet.')
  config = _config(head_type)
  params, target = _params_and_target(config)
  optimizer = optim.make_optimizer(config.optim, config.num_train_steps, params)
  opt_state = optimizer.init(params)
  legacy_params = _with_legacy_heads(_nested(params))
  legacy_opt_state = _with_legacy_heads(_nested(opt_state))
  assert _arrays(legacy_params).keys() != _arrays(params).keys()
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  checkpointer.save(3, legacy_params, legacy_opt_state, force=True)
  checkpointer.close()

  restored, step = checkpointing.restore_params(tmp_path, target)
  assert step == 3
  chex.assert_trees_all_equal_structs(restored, target)
  chex.assert_trees_all_equal(_arrays(restored), _arrays(params))
  # Resuming reads the optimizer state's copies of the parameter tree the same way.
  opt_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding),
                            jax.eval_shape(optimizer.init, target))
  checkpointer = checkpointing.Checkpointer(tmp_path, read_only=True)
  _, restored_opt = checkpointer.restore(3, opt_state=opt_target)
  checkpointer.close()
  chex.assert_trees_all_equal(_arrays(restored_opt), _arrays(opt_state))


def test_parts_and_another_models_checkpoint(tmp_path):
  params, target = _params_and_target(_config())
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  checkpointer.save_params(1, params)
  checkpointer.close()
  trunk, _ = checkpointing.restore_params(tmp_path, target, parts=[param_tree.TRUNK])
  assert list(trunk.keys()) == [param_tree.TRUNK]
  chex.assert_trees_all_equal(_arrays(trunk), _arrays(param_tree.select(params, ['trunk'])))

  _, other = _params_and_target(_config(vocab_size=128))
  with pytest.raises(checkpointing.CheckpointError, match='checkpoint is of another model'):
    checkpointing.restore_params(tmp_path, other)
  _, other = _params_and_target(_config(head_type='sequential'))
  with pytest.raises(checkpointing.CheckpointError, match='checkpoint is of another model'):
    checkpointing.restore_params(tmp_path, other)


def test_a_config_with_the_legacy_attention_heads_key_loads(tmp_path):
  if not hasattr(mtp_model, 'upgrade_legacy_config'):
    pytest.skip('mtp.model.mtp_model.upgrade_legacy_config does not exist yet.')
  config = _config().to_dict()
  config['model']['num_heads'] = config['model'].pop('num_attention_heads')
  (tmp_path / checkpointing.CONFIG_FILENAME).write_text(json.dumps(config))
  loaded = checkpointing.load_config(tmp_path)
  assert loaded.model.num_attention_heads == 4 and 'num_heads' not in loaded.model


@pytest.mark.parametrize('damage,message', [
    (lambda c: c['model'].pop('embed_dim'), 'lacks the model keys embed_dim'),
    (lambda c: c.pop('model'), 'has no "model" section'),
])
def test_a_config_with_missing_keys_is_named(tmp_path, damage, message):
  config = _config().to_dict()
  damage(config)
  path = tmp_path / checkpointing.CONFIG_FILENAME
  path.write_text(json.dumps(config))
  with pytest.raises(checkpointing.CheckpointError, match=f'{path} {message}'):
    checkpointing.load_config(tmp_path)


def _workdir(path):
  path.mkdir(parents=True)
  (path / checkpointing.CONFIG_FILENAME).write_text(json.dumps(_config().to_dict()))
  return path


def test_base_json_is_relative_so_the_pair_can_move(tmp_path):
  base, heads = _workdir(tmp_path / 'a' / 'runs' / 'base'), _workdir(tmp_path / 'a' / 'heads')
  checkpointing.write_base_reference(heads, base)
  assert json.loads((heads / 'base.json').read_text())['base_workdir'] == '../runs/base'
  (tmp_path / 'a').rename(tmp_path / 'b')
  assert checkpointing.base_reference(tmp_path / 'b' / 'heads') == tmp_path / 'b' / 'runs' / 'base'


def test_base_json_far_away_is_absolute_and_old_files_still_work(tmp_path):
  base, heads = _workdir(tmp_path / 'base'), _workdir(tmp_path / 'x' / 'y' / 'z' / 'heads')
  checkpointing.write_base_reference(heads, base)
  assert json.loads((heads / 'base.json').read_text())['base_workdir'] == str(base)
  # As written before base.json held relative paths.
  (heads / 'base.json').write_text(json.dumps({'base_workdir': str(base),
                                               'checkpoints_hold': 'heads'}))
  assert checkpointing.base_reference(heads) == base


def test_a_missing_base_is_named_with_how_to_point_at_it(tmp_path):
  base, heads = _workdir(tmp_path / 'base'), _workdir(tmp_path / 'heads')
  checkpointing.write_base_reference(heads, base)
  base.rename(tmp_path / 'elsewhere')
  with pytest.raises(checkpointing.CheckpointError,
                     match=f'{base} is not an mtp workdir.*set "base_workdir" in '
                           f'{heads / "base.json"}'):
    checkpointing.base_reference(heads)


def _truncate_params(step_dir):
  """Truncates the largest data file of a checkpoint's parameters, as a full disk leaves it."""
  data = max((f for f in (step_dir / 'params').rglob('*') if f.is_file()),
             key=lambda f: f.stat().st_size)
  with open(data, 'r+b') as f:
    f.truncate(1000)


def _collect_failed_reads():
  """Orbax leaves a failed restore's unfinished reads (coroutines) to the garbage collector:
  collected here rather than at some later moment (once inside pytest's own compile of a
  module, which then failed)."""
  gc.collect()


def _copy_with_two_steps(tiny_workdir, path):
  """A copy of the tiny workdir holding steps 2 and 4 (4 a copy of 2), step 4 truncated."""
  shutil.copytree(tiny_workdir, path)
  checkpoints = path / checkpointing.CHECKPOINT_DIRNAME
  shutil.copytree(checkpoints / '2', checkpoints / '4')
  _truncate_params(checkpoints / '4')
  return path


def test_a_truncated_checkpoint_is_named_in_one_short_line(tiny_workdir, tmp_path):
  import mtp  # pylint: disable=import-outside-toplevel
  workdir = _copy_with_two_steps(tiny_workdir, tmp_path / 'w')
  step_dir = workdir / checkpointing.CHECKPOINT_DIRNAME / '4'
  with pytest.raises(checkpointing.CheckpointError) as e:
    mtp.load(workdir, step=4)  # A step asked for: no other step will do.
  message = str(e.value)
  # Not TensorStore's 2 KB spec: short but for the paths it names (long under xdist's tmp).
  assert '\n' not in message and len(message.replace(str(tmp_path), 'T')) < 450, message
  assert f'Checkpoint {step_dir} could not be restored' in message
  assert 'OUT_OF_RANGE' in message and 'TensorStore(' not in message
  # Training would resume it: the line says which step it can resume from instead, and how.
  assert f'to resume from step 2, the one before it, move it out of {step_dir.parent}' in message
  del e
  _collect_failed_reads()


def test_loading_falls_back_to_the_newest_checkpoint_that_restores(tiny_workdir, tmp_path,
                                                                    caplog):
  import mtp  # pylint: disable=import-outside-toplevel
  workdir = _copy_with_two_steps(tiny_workdir, tmp_path / 'w')
  step_dir = workdir / checkpointing.CHECKPOINT_DIRNAME / '4'
  with caplog.at_level(logging.WARNING):
    loaded = mtp.load(workdir)
  assert loaded.step == 2
  [warning] = [r.getMessage() for r in caplog.records if 'restored step 2' in r.getMessage()]
  assert '\n' not in warning and f'{step_dir} could not be restored' in warning, warning
  assert step_dir.is_dir()  # Left untouched.
  for step in ('2', '4'):  # None restores: the newest's error.
    _truncate_params(workdir / checkpointing.CHECKPOINT_DIRNAME / step)
  with pytest.raises(checkpointing.CheckpointError, match=f'Checkpoint {step_dir} could not'):
    mtp.load(workdir)
  _collect_failed_reads()
