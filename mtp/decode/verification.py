"""One verification pass over a block of candidates, its nodes laid out in attention order.

A tree's nodes are listed breadth first (`trees.Tree`), so most of them see no prefix of the
block (their ancestors are not the nodes listed before them), and in half precision on CPU
attention gathers each such query's keys and values into its logical order
(`kv_cache.attend`). Laid out with its longest path first
(`trees.attention_order`), that path's nodes are read as a chain's. SmolLM2 in bfloat16, a
block of the heads' node and prompt lookup's 8-token chain (`auto`'s larger block on the demo
drafter): 86 ms a step at batch 4 listed breadth first, 74 ms laid out so, where a 10-token
chain takes 72; 43.6 and 39.0 ms at batch 1. The pass returns every result in node order
again, and where each node's cache entries were written, for `kv_cache.compact`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import trees as trees_lib

Array = jax.Array


def step(model, tree, nodes: Array, positions: Array, cache, lengths: Array, *,
         with_heads: bool):
  """`model.step` over a block of candidates.

  Args:
    model: an `MTPModel` (or a wrapper with its `step`).
    tree: the block's `trees.Tree`, or a per-row tree (`dynamic_trees.RowTrees`: laid out as
      it is).
    nodes: [B, N] the block's tokens in node order, root first.
    positions: [B, N] their positions.
    cache, lengths: as `MTPModel.step`'s.
    with_heads: as `MTPModel.step`'s.

  Returns:
    (StepOutput in node order, cache with the block written from slot `lengths` on, slot [N]
    int32: the block slot that holds each node's entries, or None where slot = node).
  """
  order = (trees_lib.attention_order(tree) if isinstance(tree, trees_lib.Tree)
           else None)  # A per-row tree is laid out as it is.
  if order is None or np.array_equal(order, np.arange(len(order))):  # A chain, for one.
    out, cache = model.step(nodes, positions, cache, lengths, block_mask=tree.attention_mask,
                            with_heads=with_heads)
    return out, cache, None
  mask = tree.attention_mask[order][:, order]
  out, cache = model.step(nodes[:, order], positions[:, order], cache, lengths,
                          block_mask=mask, with_heads=with_heads)
  slot = np.argsort(order).astype(np.int32)
  return jax.tree.map(lambda a: a[:, slot], out), cache, jnp.asarray(slot)
