"""Training: heads learn their offsets, frozen trunk, sharded step, exact resume, bad input."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import workdir_lock
from mtp.parallel import mesh as mesh_lib
from mtp.train import divergence
from mtp.train import preemption
from mtp.train import step as step_lib
from mtp.train import testing as train_testing
from mtp.train import trainer as trainer_lib
from mtp.train import writers


_config = train_testing.tiny_config


def _counting_batch(batch_size, seq_len, vocab, seed):
  """Rows counting up modulo `vocab` from random starts: token t+j is token t plus j."""
  starts = np.random.default_rng(seed).integers(0, vocab, (batch_size, 1))
  tokens = (starts + np.arange(seq_len)) % vocab
  return {'tokens': tokens.astype(np.int32),
          'segment_ids': np.ones((batch_size, seq_len), np.int32),
          'positions': np.broadcast_to(np.arange(seq_len), (batch_size, seq_len)).astype(np.int32)}


def _single_device_mesh():
  return mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1))


def _train_on_counting(config):
  """Trains on counting rows (vocabulary 32, length 32) and evaluates on unseen ones."""
  trainer = step_lib.Trainer(config, _single_device_mesh())
  state = trainer.init_state()
  for step in range(config.num_train_steps):
    state, _ = trainer.train_step(state, trainer.train_batch(_counting_batch(8, 32, 32, step)))
  return trainer.evaluate(state.params, [_counting_batch(8, 32, 32, 10_000)])


@pytest.mark.parametrize('head_type', ['medusa', 'parallel', 'sequential'])
def test_head_k_learns_token_t_plus_1_plus_k(head_type):
  config = _config(**{'model.mtp_head_type': head_type, 'model.vocab_size': 32,
                      'num_train_steps': 120, 'optim.warmup_steps': 10,
                      'optim.learning_rate': 1e-2})
  metrics = _train_on_counting(config)
  for k in (1, 2, 3):
    assert metrics[f'head_{k}_acc'] > 0.95, (k, metrics)
  assert metrics['ntp_acc'] > 0.95


def test_frozen_trunk_stays_bit_identical_while_heads_learn():
  config = _config(**{'optim.mode': 'frozen_trunk', 'model.mtp_head_type': 'parallel'})
  trainer = step_lib.Trainer(config, _single_device_mesh())
  state = trainer.init_state()
  before = jax.device_get(state.params)
  for step in range(3):
    state, _ = trainer.train_step(state, trainer.train_batch(_counting_batch(8, 64, 264, step)))
  after = jax.device_get(state.params)
  flat_before = dict(nnx.to_flat_state(before))
  flat_after = dict(nnx.to_flat_state(after))
  changed_heads = 0
  for path, value in flat_before.items():
    if path[0] == 'heads':
      changed_heads += not np.array_equal(value[...], flat_after[path][...])
    else:
      np.testing.assert_array_equal(value[...], flat_after[path][...], err_msg=str(path))
  assert changed_heads > 0


def test_sharded_step_on_a_2x2x2_mesh_matches_one_device():
  assert jax.device_count() >= 8, 'conftest.py asks for 8 simulated devices'
  config = _config(**{'model.mtp_head_type': 'parallel'})
  batches = [_counting_batch(8, 64, 264, s) for s in range(2)]
  results = []
  for mesh in (_single_device_mesh(), mesh_lib.make_mesh(dict(data=2, fsdp=2, tensor=2))):
    trainer = step_lib.Trainer(config, mesh)
    state = trainer.init_state()
    for batch in batches:
      state, metrics = trainer.train_step(state, trainer.train_batch(batch))
    results.append((jax.device_get(metrics), jax.device_get(state.params), state))
  (m1, p1, _), (m8, p8, sharded_state) = results
  np.testing.assert_allclose(m1['loss'], m8['loss'], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), p1, p8)
  # The parameters really are spread over the mesh.
  kernel = sharded_state.params['trunk']['blocks'][0]['mlp']['gate']['kernel'][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor')


def _losses(workdir):
  return {r['step']: r['loss'] for r in writers.read_metrics(workdir) if 'loss' in r}


def test_resume_after_sigterm_is_exact(tmp_path):
  overrides = {'num_train_steps': 8, 'log_every_steps': 1, 'eval_steps': 0,
               'checkpoint_every_steps': 100}
  straight = tmp_path / 'straight'
  trainer_lib.train_and_evaluate(_config(**overrides), straight)

  interrupted = tmp_path / 'interrupted'

  def preempt_at_step_4(metrics):
    if metrics['step'] == 4:
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(preemption.Preempted, match='step 4'):
    trainer_lib.train_and_evaluate(_config(**overrides), interrupted,
                                   on_metrics=preempt_at_step_4)
  assert checkpointing.Checkpointer(interrupted, read_only=True).all_steps() == [4]
  assert max(_losses(interrupted)) == 4
  trainer_lib.train_and_evaluate(_config(**overrides), interrupted)
  expected, got = _losses(straight), _losses(interrupted)
  assert sorted(got) == list(range(1, 9))
  for step in range(1, 9):
    assert got[step] == expected[step], (step, got[step], expected[step])


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('trained')
  trainer_lib.train_and_evaluate(_config(**{'num_train_steps': 2, 'eval_steps': 1}), workdir)
  return workdir


def test_corrupt_checkpoint_is_named_and_left_untouched(trained_workdir, tmp_path):
  workdir = tmp_path / 'corrupt'
  shutil.copytree(trained_workdir, workdir)
  step_dir = workdir / 'checkpoints' / '2'
  for f in (step_dir / 'params').rglob('*'):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b'garbage')
  before = sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in step_dir.rglob('*'))
  with pytest.raises(checkpointing.CheckpointError, match=str(step_dir)):
    trainer_lib.train_and_evaluate(_config(**{'num_train_steps': 4}), workdir)
  after = sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in step_dir.rglob('*'))
  assert before == after


@pytest.mark.parametrize('overrides,message', [
    ({'model.vocab_size': 512}, 'does not match the existing workdir'),
    ({'data.tokenizer': 'bpe'}, 'data.tokenizer'),
    ({'data.batch_size': 4}, 'data.batch_size: 8 in the workdir, 4 now'),
])
def test_workdir_mismatch_is_named(trained_workdir, overrides, message):
  with pytest.raises(ValueError, match=message):
    trainer_lib.train_and_evaluate(_config(**overrides), trained_workdir)


def test_runtime_model_settings_may_change_on_resume(trained_workdir, tmp_path):
  workdir = tmp_path / 'resumed'
  shutil.copytree(trained_workdir, workdir)
  config = _config(**{'num_train_steps': 2, 'eval_steps': 1, 'model.remat': 'full'})
  trainer_lib.train_and_evaluate(config, workdir)  # Nothing left to train; no error.


def test_tokenizer_larger_than_the_model_vocabulary_is_named(tmp_path):
  with pytest.raises(ValueError, match='vocabulary does not match'):
    trainer_lib.train_and_evaluate(_config(**{'model.vocab_size': 200}), tmp_path)


@pytest.mark.parametrize('overrides,message', [
    ({'model.mtp_head_type': 'hydra'}, "Unknown model.mtp_head_type 'hydra'"),
    ({'model.mtp_num_heads': -2}, 'mtp_num_heads must be >= 0'),
    ({'data.seq_len': 512}, r'exceeds the model\'s maximum sequence length'),
    ({'optim.mode': 'medusa3'}, "Unknown optim.mode 'medusa3'"),
    ({'data.batch_size': 6, 'mesh.data': 4}, 'does not divide over the mesh'),
    ({'mtp_loss_scaling_factor': -1.0}, 'mtp_loss_scaling_factor'),
    ({'keep_checkpoints': 0}, 'keep_checkpoints must be at least 1, got 0'),
    ({'keep_checkpoints': -1}, 'keep_checkpoints must be at least 1, got -1'),
    ({'max_bad_steps': -1}, 'max_bad_steps must be >= 0'),
])
def test_bad_config_is_named_before_compiling(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    trainer_lib.train_and_evaluate(_config(**overrides), tmp_path)
  assert not (tmp_path / 'checkpoints').exists()


@pytest.mark.parametrize('corpus', ['missing', 'empty'])
def test_missing_or_empty_corpus_is_named(tmp_path, corpus):
  directory = tmp_path / corpus
  if corpus == 'empty':
    directory.mkdir()
  with pytest.raises(ValueError, match=str(directory)):
    trainer_lib.train_and_evaluate(_config(**{'data.corpus': str(directory)}), tmp_path / 'w')


def test_heads_on_a_pretrained_trunk_keep_it_frozen(trained_workdir, tmp_path):
  """init_from + frozen_trunk (Medusa-1): new parallel heads train, the trunk is the source's."""
  import mtp
  config = _config(**{'init_from': str(trained_workdir), 'optim.mode': 'frozen_trunk',
                      'model.mtp_head_type': 'parallel', 'model.mtp_num_heads': 2,
                      'model.remat': 'heads',  # runtime settings may differ from the source
                      'num_train_steps': 2, 'eval_steps': 0})
  trainer_lib.train_and_evaluate(config, tmp_path)
  source, tuned = mtp.load(trained_workdir), mtp.load(tmp_path)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(source.model.trunk),
               nnx.state(tuned.model.trunk))
  assert tuned.model.mtp_num_heads == 2
  assert (tmp_path / 'tokenizer.json').read_text() == (trained_workdir /
                                                       'tokenizer.json').read_text()


def test_init_from_a_different_trunk_is_named(trained_workdir, tmp_path):
  config = _config(**{'init_from': str(trained_workdir), 'model.num_layers': 3})
  with pytest.raises(ValueError, match='does not match the configured trunk'):
    trainer_lib.train_and_evaluate(config, tmp_path)


def test_head_loss_stride_still_learns_every_offset():
  config = _config(**{'model.vocab_size': 32, 'num_train_steps': 120, 'optim.warmup_steps': 10,
                      'optim.learning_rate': 1e-2, 'mtp_head_loss_stride': 4})
  metrics = _train_on_counting(config)
  for k in (1, 2, 3):
    assert metrics[f'head_{k}_acc'] > 0.95, (k, metrics)


def _dir_bytes(path):
  return sum(p.stat().st_size for p in pathlib.Path(path).rglob('*') if p.is_file())


def test_heads_on_a_frozen_trunk_are_saved_alone_and_resume_exactly(trained_workdir, tmp_path):
  """The trunk stays in the base workdir (base.json names it); resuming is still exact."""
  import mtp
  config = _config(**{'init_from': str(trained_workdir), 'optim.mode': 'frozen_trunk',
                      'num_train_steps': 4, 'log_every_steps': 1, 'eval_steps': 0,
                      'checkpoint_every_steps': 2})
  trainer_lib.train_and_evaluate(config, tmp_path / 'straight')
  trainer_lib.train_and_evaluate(config, tmp_path / 'resumed', stop_after_step=2)
  trainer_lib.train_and_evaluate(config, tmp_path / 'resumed')
  losses = lambda w: [m['loss'] for m in writers.read_metrics(w) if 'loss' in m]
  assert losses(tmp_path / 'resumed') == losses(tmp_path / 'straight')

  assert checkpointing.base_reference(tmp_path / 'resumed') == trained_workdir.absolute()
  heads_bytes = _dir_bytes(tmp_path / 'resumed' / 'checkpoints' / '4' / 'params')
  full_bytes = _dir_bytes(trained_workdir / 'checkpoints' / '2' / 'params')
  assert heads_bytes < full_bytes / 2, (heads_bytes, full_bytes)
  loaded, source = mtp.load(tmp_path / 'resumed'), mtp.load(trained_workdir)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded.model.trunk),
               nnx.state(source.model.trunk))
  assert loaded.model.mtp_num_heads == config.model.mtp_num_heads


def test_keep_checkpoints_zero_deletes_nothing_on_resume(trained_workdir, tmp_path):
  workdir = tmp_path / 'resumed'
  shutil.copytree(trained_workdir, workdir)
  with pytest.raises(ValueError, match='keep_checkpoints'):
    trainer_lib.train_and_evaluate(_config(**{'num_train_steps': 4, 'keep_checkpoints': 0}),
                                   workdir)
  assert checkpointing.Checkpointer(workdir, read_only=True).all_steps() == [2]


def test_a_second_trainer_on_the_workdir_is_refused_naming_the_holder(trained_workdir, tmp_path):
  workdir = tmp_path / 'w'
  shutil.copytree(trained_workdir, workdir)
  before = sorted(p.name for p in workdir.iterdir())
  with workdir_lock.WorkdirLock(workdir):
    with pytest.raises(workdir_lock.WorkdirLockedError,
                       match=f'in use by pid {os.getpid()} on host .*delete {workdir}.lock'):
      trainer_lib.train_and_evaluate(_config(**{'num_train_steps': 4}), workdir)
  assert sorted(p.name for p in workdir.iterdir()) == before
  # A lock its holder left behind when it died does not block.
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  (tmp_path / 'w.lock').write_text(json.dumps({'pid': dead.pid, 'host': socket.gethostname()}))
  trainer_lib.train_and_evaluate(_config(**{'num_train_steps': 2, 'eval_steps': 1}), workdir)
  assert not (tmp_path / 'w.lock').exists()


def _nan_loss_at(monkeypatch, bad_steps):
  """Makes the loss (and so the gradients) NaN at the given 1-based steps."""
  original = step_lib.Trainer._loss

  def loss(self, params, batch, step=None):
    total, metrics = original(self, params, batch, step)
    if step is not None:
      factor = jnp.where(jnp.isin(step + 1, jnp.asarray(bad_steps)), jnp.nan, 1.0)
      total, metrics = total * factor, {**metrics, 'loss': metrics['loss'] * factor}
    return total, metrics
  monkeypatch.setattr(step_lib.Trainer, '_loss', loss)


def test_divergence_stops_naming_the_step_and_keeps_the_good_checkpoints(tmp_path, monkeypatch):
  _nan_loss_at(monkeypatch, list(range(5, 9)))
  config = _config(**{'num_train_steps': 8, 'checkpoint_every_steps': 2, 'keep_checkpoints': 2,
                      'log_every_steps': 100, 'eval_steps': 0})
  with pytest.raises(divergence.DivergenceError,
                     match=r'diverged at step 5 \(grad_norm nan, loss nan\)'):
    trainer_lib.train_and_evaluate(config, tmp_path)
  assert checkpointing.Checkpointer(tmp_path, read_only=True).all_steps() == [2, 4]


def test_max_bad_steps_skips_that_many_bad_steps(tmp_path, monkeypatch):
  _nan_loss_at(monkeypatch, [3])
  config = _config(**{'num_train_steps': 4, 'log_every_steps': 2, 'eval_steps': 0,
                      'max_bad_steps': 1})
  metrics = trainer_lib.train_and_evaluate(config, tmp_path)
  assert metrics['step'] == 4 and np.isfinite(metrics['loss'])
  losses = _losses(tmp_path)
  assert sorted(losses) == [2, 4] and all(np.isfinite(v) for v in losses.values())
  import mtp
  params = jax.tree.leaves(nnx.state(mtp.load(tmp_path).model))
  assert all(np.isfinite(np.asarray(p)).all() for p in params)


def test_a_failed_first_run_leaves_no_config(tmp_path):
  """A typo in data.corpus, then the corrected config, in the same workdir."""
  workdir = tmp_path / 'w'
  with pytest.raises(ValueError, match='typo'):
    trainer_lib.train_and_evaluate(_config(**{'data.corpus': str(tmp_path / 'typo')}), workdir)
  assert not (workdir / checkpointing.CONFIG_FILENAME).exists()
  trainer_lib.check_workdir_matches(workdir, _config())  # No mismatch to refuse.


def test_a_heads_workdir_and_its_base_can_move_together(trained_workdir, tmp_path):
  import mtp
  shutil.copytree(trained_workdir, tmp_path / 'a' / 'base')
  config = _config(**{'init_from': str(tmp_path / 'a' / 'base'), 'optim.mode': 'frozen_trunk',
                      'num_train_steps': 1, 'eval_steps': 0})
  trainer_lib.train_and_evaluate(config, tmp_path / 'a' / 'heads')
  (tmp_path / 'a').rename(tmp_path / 'b')
  loaded, source = mtp.load(tmp_path / 'b' / 'heads'), mtp.load(trained_workdir)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded.model.trunk),
               nnx.state(source.model.trunk))
  shutil.rmtree(tmp_path / 'b' / 'base')
  with pytest.raises(checkpointing.CheckpointError, match='base_workdir'):
    mtp.load(tmp_path / 'b' / 'heads')
