"""Attention over the cache in half precision on CPU: which queries it gathers, and that
gathering fewer changes no bit (`kv_cache.attend`)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.model import kv_cache
from mtp.model import testing


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


def test_rounded_has_the_bits_of_a_conversion():
  """Subnormal, large and overflowing values included."""
  x = jnp.asarray(np.concatenate([np.random.default_rng(0).normal(size=2000) * scale
                                  for scale in (1e-40, 1e-6, 1.0, 1e30, 3e38)]), jnp.float32)
  want = np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
  got = jax.jit(lambda x: kv_cache.rounded(x.astype(jnp.bfloat16)))(x)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want)
  with pytest.raises(TypeError, match='bfloat16 values, not float16'):
    kv_cache.rounded(x.astype(jnp.float16))


@pytest.mark.parametrize('mask', [ORDERED, BREADTH_FIRST], ids=['ordered', 'breadth_first'])
def test_a_block_given_as_written_gives_the_bits_of_one_read_back(mask):
  """Out-of-order queries may read the block's keys and values from Attention rather than back
  from the cache (a row's read-back copied its buffer); computed in the same program, they are
  rounded by an operation of their own, which XLA keeps, not only by a conversion, which it
  may skip (excess precision: a fresh `make demo` once parted from autoregressive decoding)."""
  q, keys, values = _inputs(2, len(mask))
  raw = jnp.asarray(np.random.default_rng(3).normal(size=(2, 2, len(mask), GROUPS, DIM)),
                    jnp.float32)
  lengths = jnp.asarray([130, 300], jnp.int32)

  def step(q, keys, values, raw, lengths, as_written):
    k, v = (jnp.sin(1.37 * x).astype(jnp.bfloat16) for x in raw)  # Computed here, as k, v are.
    keys, values = (kv_cache.write_slots(c, x, lengths) for c, x in ((keys, k), (values, v)))
    return kv_cache.attend(q, keys, values, lengths, mask, block=(k, v) if as_written else None)

  program = jax.jit(functools.partial(step, as_written=True)).lower(q, keys, values, raw,
                                                                    lengths).compile()
  assert 'reduce-precision(' in program.as_text()
  read_back = jax.jit(functools.partial(step, as_written=False))(q, keys, values, raw, lengths)
  np.testing.assert_array_equal(np.asarray(program(q, keys, values, raw, lengths), np.float32),
                                np.asarray(read_back, np.float32))


def _float32_products(text: str) -> list[str]:
  """The products in a compiled program's text that read float32 operands: [result shape]."""
  element_type = dict(re.findall(r'%([\w.-]+) = (\w+)\[', text))  # Names are the module's.
  products = re.findall(r'= (\w+\[[\d,]*\])\S* dot\(%([\w.-]+), %([\w.-]+)\)', text)
  return [shape for shape, *operands in products
          if any(element_type.get(o) == 'f32' for o in operands)]


@pytest.mark.parametrize('batch', [1, 4])
@pytest.mark.parametrize('mask', [ORDERED, BREADTH_FIRST, _mask([-1, 0, 1, 0, 3])],
                         ids=['ordered', 'breadth_first', 'two_chains'])
@pytest.mark.parametrize('known', [True, False], ids=['known', 'at_run_time'])
def test_every_product_of_a_tree_block_takes_the_chunks_half_precision_kernel(batch, mask,
                                                                                known):
  """At SmolLM2's attention shapes (9 query heads over 3 KV heads of 64) no product of a tree
  block runs in float32 where a one-token step's run in half precision. XLA:CPU upcasts a
  bfloat16 product too small to call a library for: the gathered queries' scores over a block
  of 13 keys once ran as float32 loops, from queries it had not rounded (excess precision), so
  their last bits parted from the same token's decoded alone, and `make demo` decoded a
  held-out prompt otherwise than autoregressive decoding (`benchmarks/block_bits.py` found
  it). The block's keys are now padded to a chunk (`_block_scores`)."""
  heads, groups, dim = 9, 3, 64
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731

  def step(raw_q, k, v, keys, values, lengths, mask):
    q = jnp.sin(raw_q).astype(jnp.bfloat16)  # Computed in the step, as queries are.
    keys, values = (kv_cache.write_slots(c, x, lengths) for c, x in ((keys, k), (values, v)))
    return kv_cache.attend(q, keys, values, lengths, mask, block=(k, v))

  def args(t):
    cache = spec(batch, groups, 4 * kv_cache.CHUNK, dim, dtype=jnp.uint16)
    return (spec(batch, t, heads, dim, dtype=jnp.float32), spec(batch, t, groups, dim),
            spec(batch, t, groups, dim), cache, cache, spec(batch, dtype=jnp.int32))

  one_token = jax.jit(functools.partial(step, mask=np.ones((1, 1), bool))).lower(*args(1))
  if _float32_products(one_token.compile(testing.DECODING_COMPILE).as_text()):
    pytest.skip('this CPU runs no bfloat16 product in half precision (AVX512-BF16)')
  t = len(mask)
  program = (jax.jit(functools.partial(step, mask=mask)) if known else
             jax.jit(step)).lower(*args(t), *([] if known else [spec(t, t, dtype=bool)]))
  assert _float32_products(program.compile(testing.DECODING_COMPILE).as_text()) == []


def test_compaction_moves_each_rows_path_and_traces_the_move_once(monkeypatch):
  """Every layer's buffer moves the same way, traced once for all of them; slot lengths + d
  then holds what slot lengths + path[d] held, in each row."""
  kv_cache._moved.clear_cache()  # Another test may have traced this shape.
  traced = []
  write = kv_cache._write_slots
  monkeypatch.setattr(kv_cache, '_write_slots',
                      lambda *a: traced.append(1) or write(*a))
  rng = np.random.default_rng(0)
  cache = kv_cache.KVCache(*(tuple(jnp.asarray(rng.normal(size=(2, GROUPS, 128, DIM)),
                                               jnp.float32) for _ in range(3))
                             for _ in range(2)))
  lengths, path = jnp.asarray([5, 9]), jnp.asarray([[0, 2, 3], [0, 1, 1]])
  moved = jax.jit(kv_cache.compact)(cache, lengths, path)
  assert len(traced) == 1
  for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(moved)):
    before, after = np.asarray(before), np.asarray(after)
    for row, (length, row_path) in enumerate(zip([5, 9], [[0, 2, 3], [0, 1, 1]])):
      np.testing.assert_array_equal(after[row, :, length:length + 3],
                                    before[row, :, [length + d for d in row_path]].swapaxes(0, 1))
      np.testing.assert_array_equal(after[row, :, :length], before[row, :, :length])
