"""mtp.load: round trip from a trained workdir, and clear errors for what is missing."""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import mtp
from configs import tiny
from mtp.checkpoint import checkpointing
from mtp.train import trainer as trainer_lib


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp('api')
  config = tiny.get_config()
  config.mesh.data = 1
  config.num_train_steps = 2
  config.eval_steps = 0
  trainer_lib.train_and_evaluate(config, path)
  return path


def test_load_returns_the_trained_model_and_tokenizer(workdir):
  loaded = mtp.load(workdir)
  assert loaded.step == 2
  assert loaded.tokenizer.kind == 'byte'
  assert loaded.config.model.mtp_num_heads == 3
  ids = jnp.asarray([loaded.tokenizer.encode('def f(x):')])
  out = loaded.model(ids, jnp.arange(ids.shape[1])[None])
  assert out.shape[:3] == (4, 1, ids.shape[1])
  assert np.isfinite(np.asarray(out)).all()


def test_missing_pieces_are_named(workdir, tmp_path):
  with pytest.raises(checkpointing.CheckpointError, match='not an mtp workdir'):
    mtp.load(tmp_path)
  with pytest.raises(checkpointing.CheckpointError, match='no step 7'):
    mtp.load(workdir, step=7)
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  shutil.rmtree(copy / 'checkpoints')
  with pytest.raises(checkpointing.CheckpointError, match='holds no checkpoint'):
    mtp.load(copy)
