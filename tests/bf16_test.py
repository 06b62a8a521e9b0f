"""bfloat16: training tracks float32 with float32 master state; bf16 decoding stays exact.

`model.dtype='bfloat16'` computes activations in bfloat16 while parameters, optimizer state,
logits and loss stay float32. Speculative decoding of a model with bfloat16 weights and
activations must emit exactly its own bfloat16 autoregressive tokens.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.decode import speculative_test
from mtp.decode import state as state_lib
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import kv_cache
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model import transformer
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


def test_float32_norm_scales_compute_the_same_bits():
  """The CPU decoding copy keeps the norms' scales in float32: the same values, so the same
  logits bit for bit; the original model keeps its bfloat16 scales."""
  model = _bf16_model('eagle')
  wide = transformer.float32_norm_scales(model)
  norms = [(m, w) for (_, m), (_, w) in zip(nnx.iter_modules(model), nnx.iter_modules(wide))
           if isinstance(m, transformer.RMSNorm)]
  assert norms and all(m.scale.dtype == jnp.bfloat16 and w.scale.dtype == jnp.float32
                       for m, w in norms)
  tokens = testing.random_tokens((2, 9), 61, seed=4)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  np.testing.assert_array_equal(wide(tokens, positions), model(tokens, positions))


def test_the_decoding_loop_carries_each_norm_scale_once_and_no_rope_frequencies():
  """Half-precision scales converted inside the loop, and RoPE's frequencies computed there,
  were each hoisted out of it by XLA as one more loop-carried array per use (SmolLM2's loop
  carried 669 arrays, 375 of them these), and compiling that loop took 13% longer."""
  model = _bf16_model('eagle')
  engine = decode_testing.engine(model, 'auto', max_new_tokens=16, lookup=3)
  state = engine.prefill(*state_lib.pad_prompts([[1, 2, 3]]),
                         decode_testing.settings(engine, 1, max_new_tokens=8))
  text = engine.compiled_text(state)['step']
  # The decoding loop: the while loop that carries the most arrays (weights and cache).
  carried = max((re.findall(r'\w+\[[\d,]*\]', line.split(' while(')[0])
                 for line in text.splitlines() if ' while(' in line), key=len)
  trunk = model.cfg.trunk
  norms = sum(isinstance(m, transformer.RMSNorm) for _, m in nnx.iter_modules(model))
  assert carried.count(f'f32[{trunk.embed_dim}]') == norms
  assert f'f32[{trunk.head_dim // 2}]' not in carried


def _steps_and_block(model, tokens, prompt_len: int, block: int):
  """Logits [B, block, V] of `block` tokens after a prompt: from one-token steps, and from one
  verification pass over the whole block."""

  @nnx.jit
  def step(model, new, cache, start):
    b, t = new.shape
    lengths = jnp.full((b,), start, jnp.int32)
    out, cache = model.step(new, lengths[:, None] + jnp.arange(t)[None], cache, lengths)
    return model.logits(out.normed), cache

  b = tokens.shape[0]
  _, cache = step(model, tokens[:, :prompt_len], model.init_cache(b, 128), 0)
  whole, _ = step(model, tokens[:, prompt_len:prompt_len + block], cache, prompt_len)
  one_by_one = []
  for j in range(block):
    logits, cache = step(model, tokens[:, prompt_len + j:prompt_len + j + 1], cache,
                         prompt_len + j)
    one_by_one.append(logits[:, 0])
  return np.stack(one_by_one, axis=1), np.asarray(whole)


@pytest.mark.parametrize('batch', [1, 2])
def test_bfloat16_one_token_steps_equal_a_verification_blocks_rows_bit_for_bit(batch):
  """What greedy exactness in bfloat16 rests on (`mtp.model.products`): each token's logits
  from one-token steps and from a block of 8 are the same bits, at batches 1 and 2 (fewer
  rows than the row-invariant kernel takes: padded)."""
  model = transformer.fused_projections(_bf16_model('eagle'))
  tokens = jnp.asarray(testing.random_tokens((batch, 20), 61, seed=2))
  one_by_one, whole = _steps_and_block(model, tokens, 12, 8)
  assert whole.dtype == np.float32
  np.testing.assert_array_equal(one_by_one, whole)


def test_bfloat16_speculative_greedy_equals_autoregressive_at_batch_one():
  model = _bf16_model('eagle')
  prompts = testing.random_tokens((1, 9), 61, seed=3)
  new = 24
  reference = decode_testing.decode(model, prompts, decoder='autoregressive',
                                    max_new_tokens=new)
  ref = np.asarray(reference.tokens)
  tree = speculative_test.TREE
  hook = speculative_test.ReferenceDrafts(trees.static_tree(tree, model.cfg.mtp_num_heads), 61)
  for mode in (speculative_test.MODEL_DRAFTS, speculative_test.ORACLE):
    out = decode_testing.decode(model, prompts, max_new_tokens=new, tree=tree, draft_hook=hook,
                                hook_data=speculative_test._hook_data(ref, mode))
    np.testing.assert_array_equal(out.tokens, ref)


@pytest.mark.parametrize('committed', [20, 124])  # 124: the tree crosses a chunk's end.
def test_bfloat16_tree_attention_equals_each_paths_own_attention_bit_for_bit(committed):
  """A tree node's attention in a verification block equals its attention when its path is
  decoded token by token (ancestors committed in order), whatever slots the tree gave them."""
  parents = [-1, 0, 0, 1, 1, 2, 3, 5]
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for node, parent in enumerate(parents):
    mask[node, node] = True
    if parent >= 0:
      mask[node] |= mask[parent]
  rng = np.random.default_rng(4)
  heads, groups, dim, slots = 6, 2, 16, 256
  keys = rng.normal(size=(1, slots, groups, dim))  # By slot here; [B, G, S, d] in the cache.
  values = rng.normal(size=(1, slots, groups, dim))
  cached = lambda x: jnp.asarray(np.swapaxes(x, 1, 2), jnp.bfloat16)  # noqa: E731
  q = jnp.asarray(rng.normal(size=(1, n, heads, dim)), jnp.bfloat16)
  attend = jax.jit(kv_cache.attend)
  lengths = jnp.asarray([committed], jnp.int32)
  block = np.asarray(attend(q, cached(keys), cached(values), lengths, jnp.asarray(mask)),
                     np.float32)
  for node in range(n):
    path = np.flatnonzero(mask[node])  # Its ancestors, then itself.
    k, v = keys.copy(), values.copy()
    k[:, committed:committed + len(path)] = keys[:, committed + path]
    v[:, committed:committed + len(path)] = values[:, committed + path]
    alone = attend(q[:, node:node + 1], cached(k), cached(v), lengths + len(path) - 1,
                   jnp.ones((1, 1), bool))
    np.testing.assert_array_equal(np.asarray(alone, np.float32)[0, 0], block[0, node])
