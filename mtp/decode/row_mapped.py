"""Row-by-row model calls inside a batched decode loop: batch-invariant, bit for bit.

XLA:CPU picks its kernels and reduction orders by shape: a row's logits in a batch of 8 differ
from the same row decoded alone in the last bits (attention reductions and matmul tilings change
with the batch size), and a greedy argmax near a tie can flip. `RowMapped` runs each model call
(`step`, `logits`, `draft_logits`, `draft_tree`) in a loop over rows, each row shaped [1, ...]:
every row then runs the batch-1 program, so its tokens are those of a batch of one, whatever
else is in the batch. The KV cache is the loop's carry, read and written in place
(`kv_cache.RowView`), so a step costs the same whatever the cache's capacity. Rows marked
inactive (finished, cancelled, filler) skip their call under `lax.cond` and cost nothing but
the branch.

The price: rows no longer share one matmul. The loop still runs a whole batch per dispatch and
host round trip, which is what an overhead-bound model on CPU gains most from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.model import kv_cache as kv_cache_lib

Array = jax.Array


class RowMapped:
  """Wraps an `MTPModel` (inside jitted code); its batched calls run one row at a time.

  Attributes other than the wrapped calls (cfg, init_cache, num_verified_cache_layers, ...)
  are the model's own.
  """

  def __init__(self, model, active: Array | None = None):
    self._model = model
    self._active = active  # [B] bool, or None: every row runs.

  def __getattr__(self, name):
    return getattr(self._model, name)

  def _map(self, call, rows, cache=None):
    """call(one row of `rows` as a batch of one, its cache) for each row, in a loop.

    The cache is the loop's carry: each call reads and writes its row in place through
    `kv_cache.RowView`s (a row sliced out and stacked back cost two copies of the whole cache
    per call). `call` returns (output, cache); an inactive row's output is zeros and the cache
    stays as it was.

    Returns:
      (outputs stacked over rows [B, ...], the cache).
    """
    b = jax.tree.leaves(rows)[0].shape[0]

    def compute(i, cache):
      row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), rows)
      out, new = call(row, None if cache is None else kv_cache_lib.row_views(cache, i))
      return jax.tree.map(lambda x: x[0], out), (
          None if cache is None else kv_cache_lib.buffers(new))

    shapes = jax.eval_shape(lambda c: compute(0, c)[0], cache)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    stacked = jax.tree.map(lambda s: jnp.zeros((b,) + s.shape, s.dtype), shapes)

    def body(i, carry):
      outputs, cache = carry
      if self._active is None:
        out, cache = compute(i, cache)
      else:
        out, cache = jax.lax.cond(self._active[i], lambda c: compute(i, c),
                                  lambda c: (zeros(), c), cache)
      outputs = jax.tree.map(
          lambda o, x: jax.lax.dynamic_update_index_in_dim(o, x, i, 0), outputs, out)
      return outputs, cache
    return jax.lax.fori_loop(0, b, body, (stacked, cache))

  def step(self, tokens, positions, cache, lengths, block_mask=None, *, with_heads=True):
    per_row_mask = block_mask is not None and block_mask.ndim == 3

    def call(r, row_cache):
      mask = r['mask'][0] if per_row_mask else block_mask
      return self._model.step(r['tokens'], r['positions'], row_cache, r['lengths'],
                              block_mask=mask, with_heads=with_heads)

    rows = dict(tokens=tokens, positions=positions, lengths=lengths)
    if per_row_mask:
      rows['mask'] = block_mask
    return self._map(call, rows, cache)

  def logits(self, normed):
    def call(r, no_cache):
      return self._model.logits(r['x']), no_cache
    out, _ = self._map(call, dict(x=normed))
    return out

  def draft_logits(self, features, tokens, last_index, cache, lengths, depth, vocab=None):
    def call(r, row_cache):  # The draft vocabulary [N] is the same for every row.
      logits, new_cache = self._model.draft_logits(r['features'], r['tokens'], r['last_index'],
                                                   row_cache, r['lengths'], depth, vocab=vocab)
      return jnp.swapaxes(logits, 0, 1), new_cache  # [1, depth, V or N]: rows first.

    rows = dict(features=features, tokens=tokens, last_index=last_index, lengths=lengths)
    logits, new_cache = self._map(call, rows, cache)  # logits [B, depth, V]
    return jnp.swapaxes(logits, 0, 1), new_cache

  def draft_tree(self, features, tokens, last_index, cache, lengths, tree, vocab=None,
                 mask=None, budget=None):
    def call(r, row_cache):
      return self._model.draft_tree(r['features'], r['tokens'], r['last_index'], row_cache,
                                    r['lengths'], tree, vocab=vocab, mask=mask, budget=budget)

    rows = dict(features=features, tokens=tokens, last_index=last_index, lengths=lengths)
    return self._map(call, rows, cache)
