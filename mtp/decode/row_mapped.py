"""Row-by-row model calls inside a batched decode loop: batch-invariant, bit for bit.

XLA:CPU picks its kernels and reduction orders by shape: a row's logits in a batch of 8 differ
from the same row decoded alone in the last bits (attention reductions and matmul tilings change
with the batch size), and a greedy argmax near a tie can flip. `RowMapped` runs each model call
(`step`, `logits`, `draft_logits`) as a `lax.map` over rows, each row shaped [1, ...]: every row
then runs the batch-1 program, so its tokens are those of a batch of one, whatever else is in
the batch. Rows marked inactive (finished, cancelled, filler) skip their call under `lax.cond`
and cost nothing but the branch.

The price: rows no longer share one matmul. The loop still runs a whole batch per dispatch and
host round trip, which is what an overhead-bound model on CPU gains most from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _first(tree):
  """Adds a leading axis of 1 to every leaf: one row as a batch of one."""
  return jax.tree.map(lambda x: x[None], tree)


def _drop_first(tree):
  return jax.tree.map(lambda x: x[0], tree)


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

  def _map(self, call, rows):
    """lax.map of call(one row as a batch of one) over the leading axis of `rows`.

    `call` returns (output, cache); an inactive row returns zeros and its cache unchanged.
    """
    def compute(r):
      return _drop_first(call(_first(r)))

    if self._active is None:
      return jax.lax.map(compute, rows)

    def one(args):
      row, active = args
      shape = jax.eval_shape(compute, row)[0]
      skip = lambda r: (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape),  # noqa
                        r['cache'])
      return jax.lax.cond(active, compute, skip, row)
    return jax.lax.map(one, (rows, self._active))

  def step(self, tokens, positions, cache, lengths, block_mask=None, *, with_heads=True):
    per_row_mask = block_mask is not None and block_mask.ndim == 3

    def call(r):
      mask = r['mask'][0] if per_row_mask else block_mask
      return self._model.step(r['tokens'], r['positions'], r['cache'], r['lengths'],
                              block_mask=mask, with_heads=with_heads)

    rows = dict(tokens=tokens, positions=positions, cache=cache, lengths=lengths)
    if per_row_mask:
      rows['mask'] = block_mask
    return self._map(call, rows)

  def logits(self, normed):
    # No cache: an empty one rides along so that every call has the same (output, cache) form.
    def call(r):
      return self._model.logits(r['x']), r['cache']
    out, _ = self._map(call, dict(x=normed, cache=jnp.zeros(normed.shape[:1])))
    return out

  def draft_logits(self, features, tokens, last_index, cache, lengths, depth, vocab=None):
    def call(r):  # The draft vocabulary [N] is the same for every row.
      logits, new_cache = self._model.draft_logits(r['features'], r['tokens'], r['last_index'],
                                                   r['cache'], r['lengths'], depth, vocab=vocab)
      return jnp.swapaxes(logits, 0, 1), new_cache  # [1, depth, V or N]: rows first.

    rows = dict(features=features, tokens=tokens, last_index=last_index, cache=cache,
                lengths=lengths)
    logits, new_cache = self._map(call, rows)  # logits [B, depth, V]
    return jnp.swapaxes(logits, 0, 1), new_cache
