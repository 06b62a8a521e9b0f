"""The blocked argmax is `jnp.argmax`, index for index, and the hot paths take it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import sampling
from mtp.model import argmax as argmax_lib
from mtp.train import loss as loss_lib


@pytest.mark.parametrize('shape', [(7, 8192), (2, 3, 4096), (128,), (5, 4100), (3, 64)])
def test_it_gives_jnp_argmax_index_for_index(shape):
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32)
  flat = x.reshape(-1, shape[-1])
  if flat.shape[0] >= 5:
    flat[0, 100 % shape[-1]] = flat[0, 3 % shape[-1]] = 50.0  # A tie: the first wins.
    flat[1] = -np.inf  # All equal.
    flat[2, -1] = np.nan  # NaN counts as the largest, as in jnp.argmax.
    flat[3, shape[-1] // 2] = flat[3, -2] = np.nan
    flat[4, -1] = np.inf
  x = jnp.asarray(flat.reshape(shape))
  for dtype in (jnp.float32, jnp.bfloat16):
    got = jax.jit(argmax_lib.argmax)(x.astype(dtype))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x.astype(dtype), axis=-1))


def _pair_reductions_over(fn, args, size: int) -> list[str]:
  """The (value, index) reductions in `fn`'s lowering whose operands have an axis of `size`
  (how jnp.argmax lowers)."""
  text = jax.jit(fn).lower(*args).as_text()
  return [line for line in text.splitlines()
          if re.search(r'%\S+:2 = stablehlo\.reduce', line)
          and re.search(rf'[<x]{size}x(f32|bf16|i32)>', line)]


def test_greedy_verification_sampling_and_the_loss_reduce_no_vocabulary_in_pairs():
  """The rule that keeps them fast: no argmax over a whole vocabulary in one pair reduction."""
  v = 8192
  logits = jnp.zeros((2, 5, v))
  drafts = jnp.zeros((2, 4), jnp.int32)
  assert _pair_reductions_over(lambda l: jnp.argmax(l, -1), (logits,), v)  # It sees them.
  assert not _pair_reductions_over(argmax_lib.argmax, (logits,), v)
  assert not _pair_reductions_over(sampling.greedy_accept_chain, (drafts, logits), v)
  assert not _pair_reductions_over(
      lambda l: sampling.sample_tokens(jax.random.key(0), l, temperature=0.0), (logits[:, 0],), v)
  x, w = jnp.zeros((16, 32)), jnp.zeros((32, v))
  assert not _pair_reductions_over(
      lambda x: loss_lib.fused_cross_entropy(x, w, jnp.zeros((16,), jnp.int32), jnp.ones((16,)),
                                             chunk_size=8), (x,), v)
