"""Key/value cache: a pytree of per-layer buffers written at per-row offsets.

Each buffer is [B, G, S, d]: row, KV head, slot, feature. A run of slots is then one contiguous
[C, d] block per head, the operand attention's products read (`attend`), as in the layouts
of Hugging Face's and vLLM's caches. A [B, S, G, d] layout made every chunk of keys and values
be transposed before its products (XLA:CPU, SmolLM2 in bfloat16 at batch 4: 18 of a one-token
step's 53 ms; see the README's decoding figures).

Every row of the batch has its own committed length. A cached forward writes its T new tokens
into slots [length, length + T) of each row and attends to the committed slots plus the new
block (through a block mask, so tree candidates see only their ancestors). Slots at or past the
committed length are scratch: rewinding a row is lowering its length, and accepting a path of
candidates is copying their slots to the front of the scratch area (`compact`).

Attention over the cache (`attend`) visits it in fixed chunks of `CHUNK` slots, only as many
as the longest row has filled, with an online softmax. Two things follow: a step costs in
proportion to the context, not to the cache's capacity, and a row's result does not depend on
the capacity at all (chunks past its length change nothing, bit for bit), so decoders whose
caches differ in size (an offline call sized for its own tokens, a server's batch sized for
its longest request) compute the same tokens. Capacities are multiples of `CHUNK`.

On CPU a half-precision cache is stored as the raw bits of its values (uint16 buffers;
`storage_dtype`): XLA:CPU slices and updates half-precision arrays in float32, and its
compiler hoists that conversion out of the chunk loop, so each attention call converted its
layer's whole buffer to float32, and each write converted it there and back: a cost in the
capacity, not the context (SmolLM2 in bfloat16 at batch 4 with 1,280 slots: 67.5 ms a greedy
step, 61.3 ms stored as bits). Reads and writes convert exactly (`stored`, `loaded`).

A row-mapped call (`decode/row_mapped.py`: one row at a time, as a batch of one) sees each
buffer as a `RowView`: the whole batch's buffer and the row it may touch. `write_slots` and
`attend` read and write that row in place; slicing the row out and stacking it back instead
copied the whole cache twice per call (a batch of 8 rows of the demo model with 2048 slots:
49 ms a one-token step, against 2.2 ms for the same step batched).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.model import products


@flax.struct.dataclass
class KVCache:
  """Keys and values of every attention layer.

  Attributes:
    keys: one [B, G, S, H] buffer per layer (rotary positions already applied), of
      `storage_dtype` (half-precision values on CPU: their bits).
    values: one [B, G, S, H] buffer per layer, as keys.
  """
  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]

  @property
  def num_layers(self) -> int:
    return len(self.keys)

  @property
  def capacity(self) -> int:
    return self.keys[0].shape[2] if self.keys else 0

  @property
  def batch_size(self) -> int:
    return self.keys[0].shape[0]


@flax.struct.dataclass
class RowView:
  """Row `row` of a cache buffer [B, G, S, d], as a [1, G, S, d] buffer that is not copied out.

  Attributes:
    buffer: the whole batch's buffer.
    row: int32 scalar, the row this call reads and writes.
  """
  buffer: jax.Array
  row: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return (1,) + tuple(self.buffer.shape[1:])

  @property
  def dtype(self):
    return self.buffer.dtype

  def read(self, start, size: int) -> jax.Array:
    """Slots [start, start + size) of the row: [1, G, size, d]."""
    _, g, _, d = self.buffer.shape
    return jax.lax.dynamic_slice(self.buffer, (self.row, 0, start, 0), (1, g, size, d))

  def astype(self, dtype) -> jax.Array:
    """The row's whole buffer (a copy) as `dtype` values: for attention over an explicit
    mask."""
    return loaded(self.read(0, self.buffer.shape[2]), dtype)


def row_views(cache: KVCache, row) -> KVCache:
  """`cache`'s buffers as `RowView`s of `row`."""
  row = jnp.asarray(row, jnp.int32)
  return KVCache(keys=tuple(RowView(k, row) for k in cache.keys),
                 values=tuple(RowView(v, row) for v in cache.values))


def buffers(cache: KVCache) -> KVCache:
  """The whole buffers behind `row_views` (as written since)."""
  return KVCache(keys=tuple(k.buffer for k in cache.keys),
                 values=tuple(v.buffer for v in cache.values))


def storage_dtype(dtype) -> jnp.dtype:
  """What a cache of `dtype` values is stored as: their raw bits (uint16) where they are half
  precision on CPU (see the module docstring), else `dtype` itself. Bits carry no gradient: a
  cache that training differentiates through (EAGLE's unrolled drafter) keeps its dtype."""
  return jnp.dtype(jnp.uint16) if products.on_fast_path(dtype) else jnp.dtype(dtype)


def stored(x: jax.Array, storage) -> jax.Array:
  """Values x as a buffer of `storage` dtype holds them (raw bits: x must be half precision,
  or bits already, as `compact` moves them)."""
  if x.dtype == jnp.dtype(storage):
    return x
  if jnp.dtype(storage) != jnp.uint16:
    return x.astype(storage)
  if jnp.dtype(x.dtype).itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'a cache stored as raw 16 bits holds half-precision values, not {x.dtype}')
  return jax.lax.bitcast_convert_type(x, jnp.uint16)


def rounded(x: jax.Array) -> jax.Array:
  """bfloat16 x with the bits of its rounding from float32, even where XLA would keep the
  float32 value it was converted from (`xla_allow_excess_precision`): rounded by
  `reduce_precision`, an operation of its own, which matches the conversion bit for bit
  (bfloat16 only: it flushes float16's subnormals to zero)."""
  if x.dtype != jnp.bfloat16:
    raise TypeError(f'rounded takes bfloat16 values, not {x.dtype}')
  return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8,
                                  mantissa_bits=7).astype(x.dtype)


def loaded(x, dtype) -> jax.Array:
  """A buffer's (a slice's, a `RowView`'s row) contents as `dtype` values: `stored`'s
  inverse."""
  if isinstance(x, RowView):
    return x.astype(dtype)
  if x.dtype != jnp.uint16:
    return x.astype(dtype)
  if jnp.dtype(dtype).itemsize != 2:
    raise TypeError(f'a cache stored as raw 16 bits holds half-precision values; read them as '
                    f'such, not as {jnp.dtype(dtype)}')
  return jax.lax.bitcast_convert_type(x, dtype)


def _chunk(buffer, i) -> jax.Array:
  """Chunk i of a buffer, slots [i * CHUNK, (i + 1) * CHUNK): [B, G, CHUNK, d].

  Read as row i of the same memory seen as [B, G, S / CHUNK, CHUNK * d]: XLA:CPU copies that
  row out faster than the same slots sliced out of [B, G, S, d] (SmolLM2 in bfloat16 at batch 4,
  a one-token step: 39.9-41.8 ms before, 37.1-37.3 after; autoregressive decoding 100-101
  tokens/s before, 106-107 after; batch 1 unchanged)."""
  if isinstance(buffer, RowView):
    return buffer.read(i * CHUNK, CHUNK)
  b, g, s, d = buffer.shape
  rows = buffer.reshape(b, g, s // CHUNK, CHUNK * d)
  return jax.lax.dynamic_index_in_dim(rows, i, axis=2, keepdims=False).reshape(b, g, CHUNK, d)


# Slots `attend` reads at a time. 128 ran as fast as attention over the whole cache at full
# occupancy on 2 CPU cores, and faster wherever the cache is partly empty.
CHUNK = 128


def round_capacity(capacity: int) -> int:
  """`capacity` rounded up to a whole number of `CHUNK`s (at least one)."""
  return max(1, -(-int(capacity) // CHUNK)) * CHUNK


def init_cache(num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> KVCache:
  """Zero buffers for `num_layers` layers, each [batch_size, num_kv_heads, S, head_dim], with
  S = `round_capacity(capacity)` >= capacity slots, of `dtype` values (stored as
  `storage_dtype(dtype)`)."""
  shape = (batch_size, num_kv_heads, round_capacity(capacity), head_dim)
  storage = storage_dtype(dtype)
  zeros = tuple(jnp.zeros(shape, storage) for _ in range(num_layers))
  return KVCache(keys=zeros, values=tuple(jnp.zeros(shape, storage) for _ in range(num_layers)))


def write_rows(buffer: jax.Array, block: jax.Array, offsets: jax.Array) -> jax.Array:
  """Writes block [B, T, ...] into buffer [B, S, ...] at slot offsets[b] of each row b (tokens,
  features; a cache layer's keys and values go through `write_slots`)."""
  def write_one(row, new, offset):
    start = (offset,) + (0,) * (row.ndim - 1)
    return jax.lax.dynamic_update_slice(row, stored(new, row.dtype), start)
  return jax.vmap(write_one)(buffer, block, offsets)


def write_slots(buffer, block: jax.Array, offsets: jax.Array):
  """Writes a layer's new keys or values, block [B, T, G, d], into its buffer [B, G, S, d] at
  slots offsets[b] of each row b (a `RowView`: block [1, T, G, d] into its row, in place)."""
  return _write_slots(buffer, jnp.swapaxes(block, 1, 2), offsets)


def _write_slots(buffer, block: jax.Array, offsets: jax.Array):
  """`write_slots` of a block already laid out as the buffer, [B, G, T, d]."""
  if isinstance(buffer, RowView):
    return buffer.replace(buffer=jax.lax.dynamic_update_slice(
        buffer.buffer, stored(block, buffer.dtype), (buffer.row, 0, offsets[0], 0)))

  def write_one(row, new, offset):
    return jax.lax.dynamic_update_slice(row, stored(new, row.dtype), (0, offset, 0))
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
  return KVCache(keys=tuple(_moved(k, lengths, path) for k in cache.keys),
                 values=tuple(_moved(v, lengths, path) for v in cache.values))


@jax.jit
def _moved(buffer: jax.Array, lengths: jax.Array, path: jax.Array) -> jax.Array:
  """One buffer [B, G, S, d] of `compact`, jitted so that a program moving every layer's
  traces the move once (SmolLM2's 60 buffers: a quarter of tracing the decode loop)."""
  nodes = jax.vmap(lambda row, offset, row_path: row[:, offset + row_path])(
      buffer, lengths, path)
  return _write_slots(buffer, nodes, lengths)


def compact_layers(cache: KVCache, lengths: jax.Array, path: jax.Array,
                   num_layers: int) -> KVCache:
  """`compact` on the first num_layers layers only (those a verification wrote; layers after
  them belong to heads that write their own entries when they draft)."""
  moved = compact(KVCache(keys=cache.keys[:num_layers], values=cache.values[:num_layers]),
                  lengths, path)
  return KVCache(keys=moved.keys + cache.keys[num_layers:],
                 values=moved.values + cache.values[num_layers:])


def attend(q: jax.Array, keys, values, lengths: jax.Array, block_mask: jax.Array,
           own: tuple[jax.Array, jax.Array, jax.Array] | None = None,
           block: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """Attention of T queries over a layer's cache, chunk by chunk (see the module docstring).

  Scores and the softmax's running state are laid out [B, G, T, R, ...] (R = H / G queries per
  KV head), the order the products give them: nothing is transposed per chunk.

  Args:
    q: [B, T, H, d] queries (rotary positions applied): usually the new tokens' own.
    keys, values: [B, G, S, d] the layer's cache with a block of N new tokens' entries already
      written at slots [lengths, lengths + N); S a multiple of `CHUNK`; G divides H (or
      `RowView`s).
    lengths: [B] committed slots per row: all of them are visible.
    block_mask: [T, N] or [B, T, N]: which of the block's tokens each query sees (the new
      tokens' own queries, T = N: itself included).
    own: optional keys each query sees besides the cache, (keys [B, T, E, G, d] rotated,
      values [B, T, E, G, d], visible [T, E] or [B, T, E] bool), in the same softmax: E keys
      of each query's own (speculative streams, `heads/streaming.py`).
    block: the block's keys and values [B, N, G, d] as `write_slots` just wrote them, where
      queries out of logical order read them (half precision on CPU) instead of reading them
      back from the cache. Read back from a row's `RowView`, XLA:CPU fused the read with the
      write and then copied the layer's whole buffer to keep it (SmolLM2's rows at 8,320
      slots: a branching tree's step cost twice a chain's). They are rounded to bfloat16 by
      an explicit operation (`rounded`), which no compiler pass removes: read straight from
      Attention, XLA may keep them in float32 (excess precision), and a query's scores would
      part, in their last bits, from those of its token decoded alone, which reads the keys
      rounded from memory. float16 blocks are read back.

  Returns:
    [B, T, H, d] in q's dtype (computed in float32).
  """
  b, t, h, d = q.shape
  g, s = keys.shape[1], keys.shape[2]
  n = block_mask.shape[-1]
  if s % CHUNK:
    raise ValueError(f'the cache holds {s} slots, not a multiple of {CHUNK} (init_cache)')
  queries = q.reshape(b, t, g, h // g, d).astype(jnp.float32) * d ** -0.5
  # In half precision on CPU, decoding is exact only if a query row's result has the same bits
  # in any block (`products`): sums in a fixed order instead of XLA's shape-dependent ones.
  fixed_order = products.on_fast_path(q.dtype)
  static = _known(block_mask)
  block_mask = jnp.broadcast_to(block_mask, (b, t, n))
  lengths = lengths.astype(jnp.int32)

  if fixed_order:
    chunk, block_chunk = _logical_chunks(q, keys, values, lengths, block_mask, static, block)
  else:
    block_chunk = None

    def chunk(i, carry):
      start = i * CHUNK
      k = loaded(_chunk(keys, i), jnp.float32)
      v = loaded(_chunk(values, i), jnp.float32)
      relative = start + jnp.arange(CHUNK)[None, :] - lengths[:, None]  # [B, C]
      in_block = jnp.take_along_axis(
          block_mask, jnp.broadcast_to(jnp.clip(relative, 0, n - 1)[:, None, :], (b, t, CHUNK)),
          axis=2) & ((relative >= 0) & (relative < n))[:, None, :]
      visible = (relative < 0)[:, None, :] | in_block  # [B, T, C]
      return _online_softmax_step(carry, jnp.einsum('btgrd,bgcd->bgtrc', queries, k), visible,
                                  lambda p: jnp.einsum('bgtrc,bgcd->bgtrd', p, v), False)

  num_chunks = jnp.minimum((jnp.max(lengths) + n + CHUNK - 1) // CHUNK, s // CHUNK)
  shape = (b, g, t, h // g)
  carry = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (d,)))
  if own is not None:  # The softmax starts from the queries' own keys.
    own_k, own_v, own_visible = own
    own_k = jnp.transpose(own_k.astype(jnp.float32), (0, 3, 1, 2, 4))  # [B, G, T, E, d]
    own_v = jnp.transpose(own_v.astype(jnp.float32), (0, 3, 1, 2, 4))
    by_head = jnp.transpose(queries, (0, 2, 1, 3, 4))  # [B, G, T, R, d]
    scores = (products.ordered_sum(by_head[..., None, :] * own_k[:, :, :, None], -1)
              if fixed_order else jnp.einsum('bgtrd,bgted->bgtre', by_head, own_k))
    visible = jnp.broadcast_to(own_visible, (b, t, own_k.shape[3]))[:, None, :, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)[..., None])
    weighted = (products.ordered_sum(p[..., None] * own_v[:, :, :, None], -2)
                if fixed_order else jnp.einsum('bgtre,bgted->bgtrd', p, own_v))
    carry = (top, _sum(p, fixed_order), weighted)
  if block_chunk is None:
    _, total, acc = jax.lax.fori_loop(0, num_chunks, chunk, carry)
  else:  # Chunks every row has committed, then those holding the block (no cond per chunk).
    committed = jnp.minimum(jnp.min(lengths) // CHUNK, num_chunks)
    carry = jax.lax.fori_loop(0, committed, chunk, carry)
    _, total, acc = jax.lax.fori_loop(committed, num_chunks, block_chunk, carry)
  out = acc / total[..., None]  # [B, G, T, R, d]
  return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, h, d).astype(q.dtype)


def _online_softmax_step(carry, scores: jax.Array, visible: jax.Array, weighted,
                         fixed_order: bool):
  """One chunk of the online softmax: carry (top, total, acc) [B, G, T, R], [B, G, T, R],
  [B, G, T, R, d]; scores [B, G, T, R, C]; visible [B, T, C]; weighted(p) = p . values."""
  top, total, acc = carry
  scores = jnp.where(visible[:, None, :, None], scores, -jnp.inf)
  new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
  shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
  # A chunk that no query sees leaves the carry exactly as it was (scale 1, p 0).
  scale = jnp.exp(top - shift)
  p = jnp.exp(scores - shift[..., None])
  return (new_top, total * scale + _sum(p, fixed_order),
          acc * scale[..., None] + weighted(p))


def _logical_chunks(q: jax.Array, keys, values, lengths: jax.Array, block_mask: jax.Array,
                    static: np.ndarray | None,
                    block: tuple[jax.Array, jax.Array] | None = None):
  """`attend`'s chunk step in half precision on CPU, where each query's result must have the
  same bits as when its token is decoded alone (`products`: exact decoding).

  Alone, a token at position P sees slots [0, P], its ancestors committed in order. In a block
  its ancestors sit at block slots wherever the tree put them. So each query reads its keys in
  *logical* order: chunk slot c holds logical position start + c, the committed slot below the
  row's length and the query's j-th visible block token from there on. Chunks that every row
  has committed are the same for all queries and are read once; in the others each query's
  scores and values are gathered into its logical order. The products are row-invariant (a
  score or a sum has the same bits whichever block computes it) and the sums run in a fixed
  order, so nothing depends on the block's shape.

  A query that sees a prefix of the block (one token, a chain, a tree's first path where the
  tree lists it first: `trees.attention_order`) is already in logical order: it is read with
  the committed chunks. Where the mask is known when tracing (`static`), only the other
  queries are gathered, or all of them where they are most (`decode/verification.py` has the
  figures). A mask known only at run time gathers every query unless all turn out in order.

  Returns:
    (committed, block): the chunk steps (i, carry) -> carry for the chunks every row has
    committed and for the others; block is None where every query reads in order. `attend`
    runs each in a loop of its own: choosing between them per chunk (`lax.cond` in one loop)
    cost SmolLM2 in bfloat16 at batch 4 about 20% of a 3-to-8-node tree's step.
  """
  b, t, h, d = q.shape
  n = block_mask.shape[-1]
  count = jnp.sum(block_mask, axis=-1, dtype=jnp.int32)  # [B, T]
  if n == 1:  # One block token: every query sees it or none does, in order either way.
    static = np.ones((t, 1), bool)
  if static is None:  # Every query is gathered, unless all of them turn out in order.
    lagging = np.arange(t)
    in_order = jnp.all(block_mask == (jnp.arange(n) < count[..., None]))
  else:
    prefix = static == (np.arange(n) < static.sum(-1, keepdims=True))
    lagging = np.flatnonzero(~prefix.all(-1).reshape(-1, t).all(0))  # Queries out of order.
    in_order = lagging.size == 0
    if 2 * lagging.size > t:  # Most of them: gathering all costs less than a second pass.
      lagging = np.arange(t)
  every = lagging.size == t
  q_lagging = q if every else q[:, lagging]
  mask_lagging = block_mask if every else block_mask[:, lagging]
  count_lagging = count if every else count[:, lagging]

  def block_reads():
    """The lagging queries' visible block tokens in index order (ancestors, then itself)
    [B, L, N], their block scores [B, G, L, R, N] and the block's values [B, G, N, d]."""
    order = jnp.argsort(~mask_lagging, axis=-1, stable=True).astype(jnp.int32)
    if block is None or block[0].dtype != jnp.bfloat16:  # float16: see `rounded`.
      block_keys, block_values = (_read_blocks(x, lengths, n) for x in (keys, values))
    else:  # As the cache holds them: the same bits, rounded explicitly (see `attend`).
      block_keys, block_values = (stored(jnp.swapaxes(rounded(x), 1, 2), buffer.dtype)
                                  for x, buffer in zip(block, (keys, values)))
    return order, _block_scores(q_lagging, block_keys), block_values

  # Only a block out of logical order reads them: a one-token step never (static), a prefill
  # chunk or a chain skips the sort and the products (2-3% of a long prompt's prefill).
  if in_order is not True:
    order, block_scores, block_values = (block_reads() if static is not None else jax.lax.cond(
        in_order, lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                       jax.eval_shape(block_reads)), block_reads))
  # [G, N, d], [L, C] -> [G, L, C, d]: each query's values in its logical order.
  gather = jax.vmap(lambda block, index: block[:, index])

  def reads(i):
    """Chunk i's keys and values [B, G, C, d] and its slots relative to each row's length."""
    k, v = _chunk(keys, i), _chunk(values, i)
    return k, v, i * CHUNK + jnp.arange(CHUNK)[None, :] - lengths[:, None]  # [B, C]

  def shared(i, carry):
    k, v, relative = reads(i)
    visible = relative[:, None, :] < count[:, :, None]  # [B, T, C]
    return _online_softmax_step(carry, _shared_scores(q, k), visible,
                                lambda p: _shared_weighted(p, v, q.dtype), True)

  if in_order is True:
    return shared, None

  def per_query(i, carry):
    k, v, relative = reads(i)
    index = jnp.take_along_axis(order, jnp.broadcast_to(
        jnp.clip(relative, 0, n - 1)[:, None, :], (b, lagging.size, CHUNK)), axis=2)
    committed = relative < 0  # [B, C]
    # A score is one query's dot product with one key: the same bits wherever it is computed.
    scores = jnp.where(committed[:, None, None, None], _shared_scores(q_lagging, k),
                       jnp.take_along_axis(block_scores, index[:, None, :, None], axis=-1))
    query_values = jnp.where(committed[:, None, None, :, None], v[:, :, None],
                             gather(block_values, index))  # [B, G, L, C, d]
    visible = relative[:, None, :] < count_lagging[:, :, None]  # [B, L, C]
    weighted = lambda p: _query_weighted(p, query_values, q.dtype)  # noqa: E731
    if every:
      return _online_softmax_step(carry, scores, visible, weighted, True)
    own = _online_softmax_step(jax.tree.map(lambda a: a[:, :, lagging], carry), scores,
                               visible, weighted, True)
    return jax.tree.map(lambda a, o: a.at[:, :, lagging].set(o), shared(i, carry), own)

  if static is not None:
    return shared, per_query
  return shared, lambda i, carry: jax.lax.cond(in_order, shared, per_query, i, carry)


def _known(mask) -> np.ndarray | None:
  """The mask's values where they are known when tracing (a tree's constant), else None."""
  if isinstance(mask, jax.core.Tracer):
    return None
  return np.asarray(mask, bool)


def _read_blocks(buffer, lengths: jax.Array, n: int) -> jax.Array:
  """Each row's block slots [lengths, lengths + n): [B, G, n, d]."""
  if isinstance(buffer, RowView):
    return buffer.read(lengths[0], n)
  return jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, n, 1))(
      buffer, lengths)


def _shared_scores(q: jax.Array, keys: jax.Array) -> jax.Array:
  """q [B, T, H, d] . keys [B, G, C, d] -> scaled scores [B, G, T, R, C] (float32), in one
  row-invariant half-precision product per group."""
  b, t, h, d = q.shape
  g = keys.shape[1]
  rows = jnp.transpose(q.reshape(b, t, g, h // g, d), (0, 2, 1, 3, 4)).reshape(
      b, g, t * (h // g), d)
  scores = jnp.einsum('bgmd,bgcd->bgmc', products.padded_rows(rows, 2), loaded(keys, q.dtype),
                      preferred_element_type=jnp.float32)[:, :, :t * (h // g)]
  return scores.reshape(b, g, t, h // g, -1) * d ** -0.5


def _block_scores(q: jax.Array, keys: jax.Array) -> jax.Array:
  """`_shared_scores` of q over the block's N keys [B, G, N, d], the keys padded with zeros to
  whole chunks so that the product has a chunk's shape and runs in its kernel. XLA:CPU hands a
  bfloat16 product to its half-precision kernel (XNNPACK) only where it would call a library
  at all: a few queries by 13 keys it ran as float32 loops of its own, from queries it had not
  rounded (excess precision), and their scores parted from the chunks' in their last bits
  (`benchmarks/block_bits.py`). Returns [B, G, T, R, N]."""
  n = keys.shape[2]
  padded = jnp.pad(keys, ((0, 0), (0, 0), (0, -n % CHUNK), (0, 0)))
  return _shared_scores(q, padded)[..., :n]


def _shared_weighted(p: jax.Array, values: jax.Array, dtype) -> jax.Array:
  """p [B, G, T, R, C] (rounded to `dtype`) . values [B, G, C, d] -> [B, G, T, R, d]."""
  b, g, t, r, c = p.shape
  rows = p.reshape(b, g, t * r, c).astype(dtype)
  out = jnp.einsum('bgmc,bgcd->bgmd', products.padded_rows(rows, 2), loaded(values, dtype),
                   preferred_element_type=jnp.float32)[:, :, :t * r]
  return out.reshape(b, g, t, r, -1)


def _query_weighted(p: jax.Array, values: jax.Array, dtype) -> jax.Array:
  """p [B, G, T, R, C] . each query's own values [B, G, T, C, d] -> [B, G, T, R, d]: the same
  bits as `_shared_weighted` where the values are the same."""
  r = p.shape[3]
  out = jnp.einsum('bgtrc,bgtcd->bgtrd', products.padded_rows(p.astype(dtype), 3),
                   loaded(values, dtype), preferred_element_type=jnp.float32)
  return out[:, :, :, :r]


def _sum(p: jax.Array, fixed_order: bool) -> jax.Array:
  return products.ordered_sum(p, -1) if fixed_order else jnp.sum(p, axis=-1)
