"""The heads' drafts for every node of a static tree: a token and a path score per node.

A drafter that verifies a tree asks the heads for `TreeDrafts` over the static tree whose nodes
it may verify: its own tree, or the superset a dynamic tree chooses from
(`mtp.decode.dynamic_trees`). Node n's token is the rank(n)-th most probable token of the
distribution drafted at its parent, and its score is the log-probability of its whole path.

Whose distribution a parent's children read is the family's business
(`HeadFamily.draft_tree`):
  * by depth (the default, any family): every node at depth d - 1 reads head d's distribution
    along the top-1 chain (Medusa-style trees: a head does not see the tokens drafted above
    it);
  * per node (EAGLE-2, `heads/eagle.py`): the drafter runs again at every expanded node, on
    that node's own path, so a second-ranked branch gets its own children.

The tree is any object with `mtp.decode.trees.Tree`'s static numpy fields (num_nodes, parent,
depth, rank, max_depth); the model never imports the decoder.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.model import products

Array = jax.Array


@flax.struct.dataclass
class TreeDrafts:
  """Every node's draft of a static tree of M nodes (root = node 0).

  Attributes:
    tokens: [B, M] int32 node n's drafted token (the root's is 0: the block's root is the
      newest accepted token, which the loop knows).
    scores: [B, M] float32 node n's path log-probability under the heads: 0 at the root, its
      parent's plus log q(token | parent's path), never more than its parent's.
  """
  tokens: Array
  scores: Array


def empty(tree, batch_size: int) -> TreeDrafts:
  """No drafts yet: tokens 0, scores -inf but the root's 0 (a node never drafted is never
  chosen)."""
  scores = jnp.full((batch_size, tree.num_nodes), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
  return TreeDrafts(tokens=jnp.zeros((batch_size, tree.num_nodes), jnp.int32), scores=scores)


def expanded_nodes(tree, depth: int) -> np.ndarray:
  """The nodes at `depth` that have children: the ones whose distribution the tree reads."""
  has_children = np.isin(np.arange(tree.num_nodes), tree.parent[1:])
  return np.nonzero((tree.depth == depth) & has_children)[0]


def assign_children(tree, drafts: TreeDrafts, parents, logits: Array,
                    token_ids: Callable[[Array], Array]) -> TreeDrafts:
  """Fills in the children of `parents` from the distributions drafted at them.

  Args:
    tree: the static tree.
    drafts: the drafts so far; the parents' scores are final.
    parents: P node indices, static [P] or per row [B, P].
    logits: [B, P, N] float32 the distribution drafted at each parent (ids never emitted at
      -inf), over N token ids or a draft vocabulary's N ids; or [B, 1, N], one distribution
      every parent reads.
    token_ids: maps indices into the N logits to token ids.

  Returns:
    `drafts` with every child c of parent p holding p's rank(c)-th candidate and score
    score(p) + log q_p(candidate).
  """
  b, m = drafts.tokens.shape
  parents = jnp.asarray(parents, jnp.int32)
  parents = jnp.broadcast_to(parents, (b,) + parents.shape[-1:])
  children = jnp.asarray(tree.children)[parents]  # [B, P, C], -1: none.
  # The rank of each child (a missing child reads the appended 0 and is dropped below).
  rank = jnp.asarray(np.append(tree.rank, 0).astype(np.int32))[children]
  values, index = jax.lax.top_k(logits, int(np.max(tree.rank)) + 1)  # [B, P or 1, R]
  # Normalised by a fixed-order sum, so that a row's scores, and the nodes a dynamic tree keeps,
  # do not depend on its neighbours (a plain reduction's bits do on XLA:CPU: `products`).
  # Rounding never lifts a child above its parent (the selection relies on it).
  log_q = jnp.minimum(values - products.ordered_logsumexp(logits), 0.0)
  shape = parents.shape + values.shape[-1:]
  index, log_q = jnp.broadcast_to(index, shape), jnp.broadcast_to(log_q, shape)
  tokens = token_ids(jnp.take_along_axis(index, rank, axis=2)).astype(jnp.int32)
  parent_scores = jnp.take_along_axis(drafts.scores, parents, axis=1)[:, :, None]
  scores = parent_scores + jnp.take_along_axis(log_q, rank, axis=2)
  rows = jnp.arange(b)[:, None, None]
  target = jnp.where(children >= 0, children, m)  # Out of range: dropped.
  return TreeDrafts(
      tokens=drafts.tokens.at[rows, target].set(tokens, mode='drop'),
      scores=drafts.scores.at[rows, target].set(scores.astype(jnp.float32), mode='drop'))


def by_depth(tree, logits: Array, token_ids: Callable[[Array], Array]) -> TreeDrafts:
  """Drafts where every node at depth d - 1 reads head d's distribution.

  Args:
    tree: the static tree (its depth <= the heads').
    logits: [depth, B, N] the heads' draft logits along the top-1 chain (masked).
    token_ids: maps indices into the N logits to token ids.
  """
  drafts = empty(tree, logits.shape[1])
  for d in range(1, tree.max_depth + 1):
    parents = np.nonzero(tree.depth == d - 1)[0]
    drafts = assign_children(tree, drafts, parents, logits[d - 1][:, None], token_ids)
  return drafts
