"""Key/value cache: a pytree of per-layer buffers written at per-row offsets.

Every row of the batch has its own committed length. A cached forward writes its T new tokens
into slots [length, length + T) of each row and attends to the committed slots plus the new
block (through a block mask, so tree candidates see only their ancestors). Slots at or past the
committed length are scratch: rewinding a row is lowering its length, and accepting a path of
candidates is copying their slots to the front of the scratch area (`compact`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Keys and values of every attention layer.

  Attributes:
    keys: one [B, S, G, H] buffer per layer (rotary positions already applied).
    values: one [B, S, G, H] buffer per layer.
  """
  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]

  @property
  def num_layers(self) -> int:
    return len(self.keys)

  @property
  def capacity(self) -> int:
    return self.keys[0].shape[1] if self.keys else 0

  @property
  def batch_size(self) -> int:
    return self.keys[0].shape[0]


def init_cache(num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> KVCache:
  """Zero buffers for `num_layers` layers, each [batch_size, capacity, num_kv_heads, head_dim]."""
  shape = (batch_size, capacity, num_kv_heads, head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
  return KVCache(keys=zeros, values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def write_rows(buffer: jax.Array, block: jax.Array, offsets: jax.Array) -> jax.Array:
  """Writes block [B, T, ...] into buffer [B, S, ...] at slot offsets[b] of each row b."""
  def write_one(row, new, offset):
    start = (offset,) + (0,) * (row.ndim - 1)
    return jax.lax.dynamic_update_slice(row, new.astype(row.dtype), start)
  return jax.vmap(write_one)(buffer, block, offsets)


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """Reads one slot per row, the counterpart of `write_rows`: x [B, T, ...], index [B] ->
  [B, ...], x[b, index[b]]."""
  index = index.reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, index, axis=1)[:, 0]


def compact(cache: KVCache, lengths: jax.Array, path: jax.Array) -> KVCache:
  """Moves the accepted path of a verified block to contiguous slots.

  Args:
    cache: cache whose slots [lengths[b], lengths[b] + T) hold a block of T candidate nodes.
    lengths: [B] committed lengths before the block was written.
    path: [B, P] block-relative node indices, root first; entry d moves to slot lengths + d.
      Pad a shorter path by repeating its last node: slots past the new length are scratch.

  Returns:
    The cache with slot lengths[b] + d holding what slot lengths[b] + path[b, d] held.
  """
  def move(buffer):
    nodes = jax.vmap(lambda row, offset, row_path: row[offset + row_path])(buffer, lengths, path)
    return write_rows(buffer, nodes, lengths)
  return KVCache(keys=tuple(move(k) for k in cache.keys),
                 values=tuple(move(v) for v in cache.values))
