"""Attention over the cache in half precision on CPU: which queries it gathers, and that
gathering fewer changes no bit (`kv_cache.attend`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.model import kv_cache


def _mask(parents):
  mask = np.zeros((len(parents),) * 2, bool)
  for node, parent in enumerate(parents):
    mask[node, node] = True
    if parent >= 0:
      mask[node] |= mask[parent]
  return mask


# A lookup chain listed first, then two heads' nodes (`trees.attention_order`): nodes 0-5 see a
# prefix of the block, nodes 6 and 7 do not.
ORDERED = _mask([-1, 0, 1, 2, 3, 4, 0, 6])
# The same tree listed breadth first: only nodes 0 and 1 see a prefix.
BREADTH_FIRST = _mask([-1, 0, 0, 1, 2, 3, 4, 5])
HEADS, GROUPS, DIM = 6, 2, 16


def _inputs(batch, num_tokens, slots=3 * kv_cache.CHUNK, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, num_tokens, HEADS, DIM)), jnp.bfloat16)
  keys, values = (kv_cache.stored(jnp.asarray(rng.normal(size=(batch, GROUPS, slots, DIM)),
                                              jnp.bfloat16), jnp.uint16) for _ in range(2))
  return q, keys, values


@pytest.mark.parametrize('mask', [ORDERED, BREADTH_FIRST], ids=['ordered', 'breadth_first'])
# 124: the block crosses a chunk; 130 and 300: both rows have a committed chunk.
@pytest.mark.parametrize('lengths', [[20, 250], [124, 128], [130, 300]])
def test_a_mask_known_when_tracing_gives_the_bits_of_one_known_at_run_time(mask, lengths):
  q, keys, values = _inputs(2, len(mask))
  lengths = jnp.asarray(lengths, jnp.int32)
  traced = jax.jit(kv_cache.attend)(q, keys, values, lengths, jnp.asarray(mask))
  known = jax.jit(lambda q, k, v, n: kv_cache.attend(q, k, v, n, mask))(q, keys, values, lengths)
  np.testing.assert_array_equal(np.asarray(known, np.float32), np.asarray(traced, np.float32))


def _gathered_queries(mask, known: bool) -> set[int]:
  """The query counts L > 1 of the per-query value arrays [B, G, L, C, d] that attention
  compiles (L = 1: the shared values broadcast against them)."""
  q, keys, values = _inputs(1, len(mask))
  lengths = jnp.asarray([20], jnp.int32)
  if known:
    step = jax.jit(lambda q, k, v, n: kv_cache.attend(q, k, v, n, mask))
    text = step.lower(q, keys, values, lengths).as_text()
  else:
    text = jax.jit(kv_cache.attend).lower(q, keys, values, lengths, jnp.asarray(mask)).as_text()
  shape = re.compile(rf'tensor<1x{GROUPS}x(\d+)x{kv_cache.CHUNK}x{DIM}x')
  return {int(m) for m in shape.findall(text)} - {1}


def test_only_the_queries_that_see_no_prefix_of_the_block_are_gathered():
  """Where the mask is known when tracing, attention gathers keys and values into logical
  order only for the queries that need it: in a block laid out in attention order, the heads'
  nodes beside a lookup chain (SmolLM2 at batch 4: 74 ms a step, 86 ms where all are)."""
  assert _gathered_queries(ORDERED, known=True) == {2}
  assert _gathered_queries(ORDERED, known=False) == {8}
  assert _gathered_queries(BREADTH_FIRST, known=True) == {8}  # 6 of 8: all are gathered.
  assert _gathered_queries(np.tril(np.ones((8, 8), bool)), known=True) == set()


def _branches(text: str) -> int:
  return text.count('stablehlo.case') + text.count('stablehlo.if')


def test_a_tree_known_when_tracing_reads_its_chunks_without_a_choice_per_chunk():
  """Committed chunks and the block's chunks run in loops of their own: a choice between the
  two per chunk (`lax.cond`) cost SmolLM2 at batch 4 about a fifth of a tree's step."""
  q, keys, values = _inputs(2, len(BREADTH_FIRST))
  lengths = jnp.asarray([130, 300], jnp.int32)
  known = jax.jit(lambda q, k, v, n: kv_cache.attend(q, k, v, n, BREADTH_FIRST))
  assert _branches(known.lower(q, keys, values, lengths).as_text()) == 0
  # A mask known only at run time still asks whether its queries turned out in order.
  traced = jax.jit(kv_cache.attend).lower(q, keys, values, lengths, jnp.asarray(BREADTH_FIRST))
  assert _branches(traced.as_text()) > 0
