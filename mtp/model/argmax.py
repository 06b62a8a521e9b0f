"""The argmax over a vocabulary, as `jnp.argmax` gives it, in reductions XLA:CPU vectorises.

`jnp.argmax` is one reduction over (value, index) pairs, which XLA:CPU runs element by element:
36 ms for [1024, 8192] logits and 1.7-3.1 ms for a 13-token block's [13, 49152], where a plain
maximum takes 1 and 0.2 ms. The demo drafter's training step spent about 7% of its time there
(its accuracy metrics), and SmolLM2's verification with lookup drafts about 1.5% (0.7 ms a
step). Here each block of `BLOCK` values is reduced to its maximum first (a plain, vectorised
reduction), and the pair reduction runs over the block maxima and over the winning block only:
4-15x faster on those shapes, with the same index as `jnp.argmax` (the first of the largest,
NaN counting as the largest). Other backends keep `jnp.argmax`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
BLOCK = 64  # Values per block: 64 measured fastest of 64, 128 and 256 on [1024, 8192].


def argmax(x: Array) -> Array:
  """The index [...] int32 of the first largest value of x [..., V] along its last axis."""
  v = x.shape[-1]
  if jax.default_backend() != 'cpu' or v < 2 * BLOCK or v % BLOCK:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  blocks = x.reshape(x.shape[:-1] + (v // BLOCK, BLOCK))
  # XLA:CPU's vectorised maximum may pass over NaN, which jnp.argmax counts as the largest.
  maxima = jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.nan, jnp.max(blocks, axis=-1))
  best_block = jnp.argmax(maxima, axis=-1)  # The first block holding the largest.
  within = jnp.take_along_axis(blocks, best_block[..., None, None], axis=-2)[..., 0, :]
  return (best_block * BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)
