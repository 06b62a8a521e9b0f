"""The jitted steps: one compilation each across steps and batches, and an explicit batch type."""

import chex
import jax
import numpy as np
import pytest

from mtp.train import step as step_lib
from mtp.train import trainer_test


class _CountingTrainer(step_lib.Trainer):
  """Fails on a second trace of either step (each trace is a compilation)."""

  @chex.assert_max_traces(n=1)
  def _train_step(self, state, batch):
    return super()._train_step(state, batch)

  @chex.assert_max_traces(n=1)
  def _eval_step(self, params, batch):
    return super()._eval_step(params, batch)


def test_train_and_eval_steps_compile_once_across_steps_and_batches():
  chex.clear_trace_counter()
  config = trainer_test._config(**{'model.mtp_head_type': 'parallel', 'model.vocab_size': 32})
  trainer = _CountingTrainer(config, trainer_test._single_device_mesh())
  state = trainer.init_state()
  abstract = jax.eval_shape(lambda s: s, state)
  for seed in range(4):
    batch = trainer.train_batch(trainer_test._counting_batch(8, 32, 32, seed))
    chex.assert_shape([batch.tokens, batch.positions, batch.segment_ids], (8, 32))
    assert batch.targets is None and batch.trunk_hidden is None and batch.head_mask is None
    state, metrics = trainer.train_step(state, batch)
    chex.assert_tree_all_finite(metrics)
  # Donated and updated, the state keeps its tree, shapes and dtypes (no retrace from there).
  chex.assert_trees_all_equal_shapes_and_dtypes(state, abstract)
  for _ in range(2):
    trainer.evaluate(state.params, [trainer_test._counting_batch(8, 32, 32, s)
                                    for s in (100, 101, 102)])
  assert trainer.train_step._cache_size() == 1 and trainer.eval_step._cache_size() == 1
  # The initialisation compiles in seconds on a GPU only with threefry lowered as its kernel
  # (see Trainer); this CPU suite cannot time that, so it checks that the trainer asks for it.
  assert jax.config.jax_threefry_gpu_kernel_lowering


def test_a_batch_holds_exactly_the_configured_fields():
  arrays = trainer_test._counting_batch(8, 16, 32, 0)
  arrays['targets'] = arrays['tokens']
  mesh = trainer_test._single_device_mesh()
  plain = step_lib.Batch.from_arrays(arrays, (), mesh)
  assert plain.targets is None  # A key the run does not use is not read.
  distilled = step_lib.Batch.from_arrays(arrays, ('targets',), mesh)
  np.testing.assert_array_equal(distilled.targets, arrays['tokens'])
  # The two variants are different trees, so each compiles its own step, by design.
  assert jax.tree.structure(plain) != jax.tree.structure(distilled)
  with pytest.raises(KeyError, match='trunk_hidden'):
    step_lib.Batch.from_arrays(arrays, ('trunk_hidden',), mesh)


def test_a_trainer_compiles_no_draw_until_a_state_is_drawn_and_states_land_as_it_says():
  """A resumed run restores its state, and reads only the trainer's shardings: building the
  trainer draws (and compiles) nothing. The drawn state's shardings are the ones it gave."""
  config = trainer_test._config(**{'model.mtp_head_type': 'parallel', 'model.vocab_size': 32})
  trainer = step_lib.Trainer(config, trainer_test._single_device_mesh())
  # pylint: disable=protected-access
  assert trainer._init_fresh._cache_size() == 0 and trainer._init_on_trunk._cache_size() == 0
  state = trainer.init_state()
  assert trainer._init_fresh._cache_size() == 1
  assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(
      trainer.state_shardings)
  assert jax.tree.structure(state) == jax.tree.structure(trainer.abstract_state)


def test_a_state_from_a_given_trunk_is_the_fresh_state_with_that_trunk():
  """`init_state(trunk=...)` (a run from a pretrained trunk) gives exactly what drawing every
  parameter and then replacing the trunk gave: the heads' draws, the trunk, the optimizer
  state, the shardings; without drawing that trunk (XLA drops the dead draw)."""
  from mtp.checkpoint import param_tree  # pylint: disable=import-outside-toplevel
  config = trainer_test._config(**{'model.mtp_head_type': 'parallel', 'model.vocab_size': 32})
  trainer = step_lib.Trainer(config, trainer_test._single_device_mesh())
  fresh = trainer.init_state()
  shardings = jax.tree.map(lambda x: x.sharding, fresh)
  other = jax.tree.map(lambda x: x + 1, param_tree.select(fresh.params, [param_tree.TRUNK]))
  want = jax.device_get(fresh.replace(params=param_tree.replace(fresh.params, other)))
  got = trainer.init_state(trunk=other)  # Donates `other`: the trunk is not copied.
  chex.assert_trees_all_equal(jax.device_get(got), want)
  assert jax.tree.map(lambda x: x.sharding, got) == shardings
  # The trunk's draws are dead code: fewer of threefry's xors are left in the program.
  # pylint: disable=protected-access
  on_trunk = trainer._init_on_trunk.lower(param_tree.select(got.params, [param_tree.TRUNK]))
  drawn_all = trainer._init_fresh.lower().compile().as_text().count(' xor(')
  assert 0 < on_trunk.compile().as_text().count(' xor(') < drawn_all
