"""Dynamic candidate trees (EAGLE-2): each step, each row verifies its own most probable nodes.

A static tree (`trees.Tree`) spends its N nodes on the same ranks every step, whatever the
heads believe. A dynamic tree keeps a larger static tree, the *superset*, and at every step
picks per row the N - 1 superset nodes whose drafts the heads find most probable together:
node n scores the sum of log q(token) over the drafts on its path, q the distribution drafted
at each node's parent (`heads.TreeDrafts`: head d's softmax for most families, the drafter's
own at that parent for EAGLE, whose every superset node gets its own children). The
N nodes are the block that one trunk pass verifies, so its cost stays fixed (a budget,
`DecodeRequest.tree_budget`) while its shape follows the heads' confidence: deep where they
are sure, wide where they hesitate.

Shapes stay static: every row verifies N nodes; only which superset nodes they are, and so
their parents, depths and attention mask, changes per step and per row (`RowTrees`, [B, ...]
arrays). The selection is prefix-closed without any repair: a child's score is its parent's
plus a log-probability <= 0, so never more, and `lax.top_k` prefers the lower index on ties,
where parents precede children. Siblings rank their tokens by the same distribution, so
a node's selected children are always its first ones in rank order, as the rejection sampler
(`sampling.rejection_accept_tree`) tries them.

Exactness does not depend on the selection: verification accepts only what the trunk agrees
with (greedy) or what rejection sampling accepts with deterministic candidates (sampling),
whichever nodes were chosen.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import trees as trees_lib

Array = jax.Array


@flax.struct.dataclass
class RowTrees:
  """Every row's candidate tree of N nodes, root = node 0, parents before children.

  Attributes:
    parent: [B, N] int32 parent node, -1 for the root.
    depth: [B, N] int32 root 0.
    node_paths: [B, N, max_depth + 1] int32 root-first path to each node, padded with -1.
    children: [B, N, max_children] int32 children in rank order, padded with -1.
    num_children: [B, N] int32.
    attention_mask: [B, N, N] bool, node i sees node j iff j is i or an ancestor of i.
    max_depth, max_children: static bounds over every row's tree.
    max_tries: static bound on the child tests of one rejection-sampling walk.
  """
  parent: Array
  depth: Array
  node_paths: Array
  children: Array
  num_children: Array
  attention_mask: Array
  max_depth: int = flax.struct.field(pytree_node=False)
  max_children: int = flax.struct.field(pytree_node=False)
  max_tries: int = flax.struct.field(pytree_node=False)


def max_tries(tree: trees_lib.Tree) -> int:
  """Most child tests a rejection-sampling walk makes on `tree` (or on any tree of selected
  nodes of it, which keeps each node's children a rank prefix): the tests to reach a node
  plus all of its children."""
  to_reach = np.zeros(tree.num_nodes, np.int64)
  for n in range(1, tree.num_nodes):  # Parents precede children.
    position = int(np.nonzero(tree.children[tree.parent[n]] == n)[0][0])
    to_reach[n] = to_reach[tree.parent[n]] + position + 1
  return int(np.max(to_reach + tree.num_children))


def broadcast(tree: trees_lib.Tree, batch_size: int) -> RowTrees:
  """The static `tree` as every row's tree."""
  def rows(a):
    return jnp.broadcast_to(jnp.asarray(a), (batch_size,) + a.shape)
  return RowTrees(parent=rows(tree.parent), depth=rows(tree.depth),
                  node_paths=rows(tree.node_paths), children=rows(tree.children),
                  num_children=rows(tree.num_children),
                  attention_mask=rows(tree.attention_mask), max_depth=tree.max_depth,
                  max_children=tree.max_children, max_tries=max_tries(tree))


def as_rows(tree: trees_lib.Tree | RowTrees, batch_size: int) -> RowTrees:
  """`tree` as per-row arrays (a `RowTrees` is returned as it is)."""
  return tree if isinstance(tree, RowTrees) else broadcast(tree, batch_size)


def check_superset(superset: trees_lib.Tree, budget: int) -> None:
  """Raises ValueError unless `budget` nodes can be chosen from the heads' nodes of `superset`."""
  if superset.lookup_depth:
    raise ValueError('a dynamic tree chooses among the heads\' drafts only: its superset has '
                     f'a lookup chain of {superset.lookup_depth} nodes')
  if (isinstance(budget, bool) or not isinstance(budget, (int, np.integer))
      or not 2 <= budget <= superset.num_nodes):
    raise ValueError(f'tree_budget must be an integer in [2, {superset.num_nodes}] (nodes per '
                     f'step, root included, of a superset tree of {superset.num_nodes} nodes), '
                     f'got {budget!r}')


def reachable(superset: trees_lib.Tree, budget: int) -> trees_lib.Tree:
  """`superset` without the nodes that `budget` nodes never reach: those deeper than
  budget - 1 (a chain of the budget). Fewer heads then draft: each head costs a pass of its
  own and a projection onto the vocabulary, whether its drafts are chosen or not."""
  if superset.max_depth < budget:
    return superset
  return trees_lib.tree_from_choices([p for p in superset.choices if len(p) < budget])


def select(scores: Array, budget: int) -> Array:
  """Every row's `budget` best superset nodes, root included, in superset (BFS) order.

  Args:
    scores: [B, M] float32 each superset node's path log-probability under the heads
      (`heads.TreeDrafts.scores`: 0 at the root, a child never above its parent).
    budget: N, nodes per row, 2 <= N <= M.

  Returns:
    [B, N] int32 superset node indices, ascending, starting with the root (0).
  """
  _, best = jax.lax.top_k(scores[:, 1:], budget - 1)
  chosen = jnp.sort(best.astype(jnp.int32) + 1, axis=1)
  return jnp.pad(chosen, ((0, 0), (1, 0)))


def row_trees(superset: trees_lib.Tree, nodes: Array) -> RowTrees:
  """The trees of the selected superset `nodes` [B, N] (`select`), in block-slot indices."""
  b, n = nodes.shape
  m = superset.num_nodes
  rows = jnp.arange(b)[:, None]
  # slot[b, s]: block slot of superset node s in row b, -1 when not selected.
  slot = jnp.full((b, m + 1), -1, jnp.int32).at[rows, nodes].set(
      jnp.arange(n, dtype=jnp.int32)[None, :])

  def to_slots(superset_nodes):  # -1 (none) maps to the extra column, itself -1.
    return slot[rows.reshape((b,) + (1,) * (superset_nodes.ndim - 1)),
                jnp.where(superset_nodes < 0, m, superset_nodes)]

  children = to_slots(jnp.asarray(superset.children)[nodes])  # [B, N, C]
  mask = jnp.asarray(superset.attention_mask)[nodes[:, :, None], nodes[:, None, :]]
  return RowTrees(parent=to_slots(jnp.asarray(superset.parent)[nodes]),
                  depth=jnp.asarray(superset.depth)[nodes],
                  node_paths=to_slots(jnp.asarray(superset.node_paths)[nodes]),
                  children=children,
                  num_children=jnp.sum(children >= 0, axis=-1, dtype=jnp.int32),
                  attention_mask=mask, max_depth=superset.max_depth,
                  max_children=superset.max_children, max_tries=max_tries(superset))


def default_superset(num_heads: int, num_nodes: int = 64) -> trees_lib.Tree:
  """A superset for dynamic trees: the `num_nodes` best nodes under a typical profile of heads'
  accuracies (`trees.medusa_default_tree`'s), cut to `num_heads` heads; deep and wide enough
  that a budget of up to about a third of it has room to follow the heads."""
  if num_heads < 1:
    raise ValueError(f'a dynamic tree needs MTP heads, got num_heads={num_heads}')
  return trees_lib.best_tree(trees_lib.TYPICAL_HEAD_ACCURACIES[:num_heads], num_nodes)
