"""bfloat16: training tracks float32 with float32 master state; bf16 decoding stays exact.

`model.dtype='bfloat16'` computes activations in bfloat16 while parameters, optimizer state,
logits and loss stay float32. Speculative decoding of a model with bfloat16 weights and
activations must emit exactly its own bfloat16 autoregressive tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.decode import speculative_test
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import mtp_model
from mtp.model import testing
from mtp.train import step as step_lib
from mtp.train import testing as train_testing
from mtp.train import trainer_test

STEPS = 20
# bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); over 20 steps on the tiny
# config its losses stay within 1% of float32's (measured: 0.05% at most).
TRACKING_RTOL = 1e-2


def _losses(dtype):
  config = train_testing.tiny_config(**{'model.dtype': dtype, 'model.vocab_size': 32,
                                        'num_train_steps': STEPS})
  trainer = step_lib.Trainer(config, trainer_test._single_device_mesh())
  state = trainer.init_state()
  losses = []
  for step in range(STEPS):
    batch = trainer.train_batch(trainer_test._counting_batch(8, 32, 32, step))
    state, metrics = trainer.train_step(state, batch)
    assert metrics['loss'].dtype == jnp.float32
    losses.append(float(metrics['loss']))
  return np.asarray(losses), state


def test_a_bfloat16_run_tracks_the_float32_run_with_float32_master_state():
  reference, _ = _losses('float32')
  losses, state = _losses('bfloat16')
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  assert losses[-1] < 0.8 * losses[0]  # It learns.
  np.testing.assert_allclose(losses, reference, rtol=TRACKING_RTOL)
  assert np.any(losses != reference)  # It did compute in bfloat16.


def _bf16_model(head_type):
  cfg = testing.tiny_config(head_type=head_type)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype='bfloat16',
                                                           param_dtype='bfloat16'))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)  # Medusa's zero-initialised kernels come alive, as in testing.
  for path, param in nnx.iter_graph(model.heads):
    if isinstance(param, nnx.Param) and path and path[-1] == 'kernel' and not np.any(
        np.asarray(param[...], np.float32)):
      param[...] = jnp.asarray(rng.normal(0, 0.3, param[...].shape), jnp.bfloat16)
  return model


def test_bfloat16_speculative_greedy_equals_bfloat16_autoregressive():
  model = _bf16_model('medusa')
  assert model.trunk.embedding.embedding[...].dtype == jnp.bfloat16
  prompts = testing.random_tokens((3, 7), 61, seed=1)
  lengths = speculative_test.PROMPT_LENGTHS
  new = speculative_test.MAX_NEW
  reference = decode_testing.decode(model, prompts, lengths, decoder='autoregressive',
                                    max_new_tokens=new)
  tree = speculative_test.TREE
  hook = speculative_test.ReferenceDrafts(trees.static_tree(tree, model.cfg.mtp_num_heads), 61)
  ref = np.asarray(reference.tokens)
  for mode in (speculative_test.MODEL_DRAFTS, speculative_test.ORACLE,
               speculative_test.RAGGED):
    out = decode_testing.decode(model, prompts, lengths, max_new_tokens=new, tree=tree,
                                draft_hook=hook, hook_data=speculative_test._hook_data(ref, mode))
    np.testing.assert_array_equal(out.tokens, ref)
    if mode == speculative_test.ORACLE:  # Whole paths verified at once: several tokens a step.
      assert np.all(np.asarray(out.num_steps) < np.asarray(reference.num_generated) - 1)
