"""A run saved on a 2x2x2 (data x fsdp x tensor) mesh resumes on other meshes, its losses
continuing those of the uninterrupted run to float tolerance; the optimizer state is sharded
as the parameters; a mesh or batch that does not fit the devices is named before anything runs.

The one-device resume uses a mesh over the first of the 8 simulated devices (`make_mesh` with
a 1x1x1 mesh): its arrays then live on one device, as in a one-device process, without starting
a second JAX process (a subprocess would pay JAX's start and every compile again).
"""

import math
import shutil

import jax
import numpy as np
import pytest

from mtp.checkpoint import checkpointing
from mtp.parallel import mesh as mesh_lib
from mtp.train import step as step_lib
from mtp.train import testing as train_testing
from mtp.train import trainer as trainer_lib
from mtp.train import writers

SAVED_MESH = dict(data=2, fsdp=2, tensor=2)
NUM_STEPS = 4
RESUMED_FROM = 2
# Per-step losses of the tiny model (about 5.6) after a restore onto another mesh differ from
# the uninterrupted run's only by the order of float32 reductions.
LOSS_RTOL = 1e-5


def _config(mesh):
  config = train_testing.tiny_config(**{
      'num_train_steps': NUM_STEPS, 'log_every_steps': 1, 'checkpoint_every_steps': RESUMED_FROM,
      'keep_checkpoints': 3, 'eval_steps': 0})
  for axis, size in mesh.items():
    config.mesh[axis] = size
  return config


def _losses(workdir):
  return {r['step']: (r['loss'], r['ntp_loss']) for r in writers.read_metrics(workdir)
          if 'loss' in r}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """A 2x2x2 run of NUM_STEPS steps with a checkpoint at RESUMED_FROM."""
  workdir = tmp_path_factory.mktemp('saved') / 'run'
  trainer_lib.train_and_evaluate(_config(SAVED_MESH), workdir)
  return workdir


@pytest.mark.parametrize('mesh', [dict(data=1, fsdp=1, tensor=1),
                                  dict(data=1, fsdp=4, tensor=2)],
                         ids=['one_device', 'fsdp4_tensor2'])
def test_resume_on_another_mesh_continues_the_losses(uninterrupted, tmp_path, mesh):
  # The workdir as a run stopped after step RESUMED_FROM left it.
  workdir = tmp_path / 'run'
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(workdir / checkpointing.CHECKPOINT_DIRNAME / str(NUM_STEPS))
  trainer_lib.train_and_evaluate(_config(mesh), workdir)
  expected, resumed = _losses(uninterrupted), _losses(workdir)
  assert sorted(resumed) == list(range(1, NUM_STEPS + 1))
  for step in range(RESUMED_FROM + 1, NUM_STEPS + 1):
    np.testing.assert_allclose(resumed[step], expected[step], rtol=LOSS_RTOL,
                               err_msg=f'step {step} on {mesh}')
  worst = max(abs(r - e) / abs(e) for step in range(RESUMED_FROM + 1, NUM_STEPS + 1)
              for r, e in zip(resumed[step], expected[step]))
  print(f'Resumed on {mesh}: losses of steps {RESUMED_FROM + 1}..{NUM_STEPS} within a relative '
        f'{worst:.1e} of the uninterrupted 2x2x2 run.')
  # Steps before the restore are the saved run's own records, kept as they were.
  for step in range(1, RESUMED_FROM + 1):
    assert resumed[step] == expected[step]


@pytest.mark.parametrize('mesh,batch_size,message', [
    (dict(data=3, fsdp=1, tensor=1), 8, r'data=3 x fsdp=1 x tensor=1 \(3 devices\) does not '
                                        r'divide the 8 devices'),
    (dict(data=1, fsdp=4, tensor=2), 6, r'data.batch_size \(6\) does not divide over the mesh'),
])
def test_a_mesh_that_does_not_fit_is_named_before_anything_runs(tmp_path, mesh, batch_size,
                                                                 message):
  config = _config(mesh)
  config.data.batch_size = batch_size
  with pytest.raises(mesh_lib.MeshError, match=message):
    trainer_lib.train_and_evaluate(config, tmp_path / 'run')
  assert not (tmp_path / 'run').exists()


def test_optimizer_state_is_sharded_as_the_parameters():
  mesh = dict(data=1, fsdp=4, tensor=2)
  trainer = step_lib.Trainer(_config(mesh), mesh_lib.make_mesh(mesh))

  def bytes_per_device(tree, shardings):
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
  state, shardings = trainer.abstract_state, trainer.state_shardings
  params = bytes_per_device(state.params, shardings.params)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  assert params < total / 2  # The parameters are sharded...
  # ... and Adam's two moments with them, not replicated on every device (scalars aside).
  assert bytes_per_device(state.opt_state, shardings.opt_state) <= 2 * params + 1024

