"""Bit-exact fingerprints of saved arrays, so a corrupted checkpoint is caught when restored.

Orbax's zarr3 chunks carry a checksum of their shard index only, not of the data: a flipped
byte inside a compressed chunk can decompress into wrong values (NaN, 5.7e27) without any error.
Each checkpoint therefore also holds one 32-bit fingerprint per array, recomputed on restore.

The fingerprint of an array x with raw bits b_i (as unsigned integers) at flat index i is
sum_i b_i * (2 i + 1) mod 2^32. Flipping any one bit changes it (the weight is odd), it reads
every element once, and it is a sum: a sharded array is fingerprinted where it lies, in one
jitted reduction, with no gather.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def fingerprints(tree: Any) -> dict[str, list]:
  """{'a/b/c': [dtype name, fingerprint]} of every array leaf of `tree`, keyed by its path."""
  paths, leaves = [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, 'dtype') and np.dtype(leaf.dtype).itemsize in _UNSIGNED:
      paths.append(path_name(path))
      leaves.append(leaf)
  values = jax.device_get(_fingerprint_all(leaves))
  return {name: [np.dtype(leaf.dtype).name, int(value)]
          for name, leaf, value in zip(paths, leaves, values)}


def mismatches(tree: Any, saved: dict[str, list]) -> list[str]:
  """Paths of the arrays of `tree` whose fingerprint differs from the `saved` one (arrays read
  back in another dtype than saved are not compared)."""
  now = fingerprints(tree)
  return [name for name, (dtype, value) in now.items()
          if name in saved and saved[name][0] == dtype and saved[name][1] != value]


def path_keys(path) -> tuple[str, ...]:
  """A pytree path's keys as strings ('a', 'b', '0', 'c'), as Orbax names the saved arrays."""
  def name(key):
    for attribute in ('key', 'name', 'idx'):
      if hasattr(key, attribute):
        return str(getattr(key, attribute))
    return str(key)
  return tuple(name(key) for key in path)


def path_name(path) -> str:
  """A pytree path as 'a/b/0/c'."""
  return '/'.join(path_keys(path))


@jax.jit
def _fingerprint_all(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_fingerprint(jnp.asarray(x)) for x in leaves]


def _fingerprint(x: jax.Array) -> jax.Array:
  """[] uint32 fingerprint of x (any shape; 1, 2 or 4 bytes per element)."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
  # The flat index from one iota per axis: no reshape, so a sharded array stays where it is.
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride)
    stride = (stride * x.shape[axis]) % 2 ** 32
  return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)
