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

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

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
  """All-zero drafts of `tree` (a loop carry before the first drafts)."""
  zeros = jnp.zeros((batch_size, tree.num_nodes), jnp.int32)
  return TreeDrafts(tokens=zeros, scores=zeros.astype(jnp.float32))


def expanded_nodes(tree, depth: int) -> np.ndarray:
  """The nodes at `depth` that have children: the ones whose distribution the tree reads."""
  has_children = np.isin(np.arange(tree.num_nodes), tree.parent[1:])
  return np.nonzero((tree.depth == depth) & has_children)[0]


def assign_children(tree, drafts: TreeDrafts, parents: Sequence[int], logits: Array,
                    token_ids: Callable[[Array], Array]) -> TreeDrafts:
  """Fills in the children of `parents` from the distributions drafted at them.

  Args:
    tree: the static tree.
    drafts: the drafts so far; the parents' scores are final.
    parents: P static node indices.
    logits: [B, P, N] float32 the distribution drafted at each parent (ids never emitted at
      -inf), over N token ids or a draft vocabulary's N ids; or [B, 1, N], one distribution
      every parent reads.
    token_ids: maps indices into the N logits to token ids.

  Returns:
    `drafts` with every child c of parent p holding p's rank(c)-th candidate and score
    score(p) + log q_p(candidate).
  """
  column = {int(p): i for i, p in enumerate(parents)}
  children = np.array([c for c in range(1, tree.num_nodes) if int(tree.parent[c]) in column],
                      np.int64)
  if not children.size:
    return drafts
  rank = tree.rank[children]
  values, index = jax.lax.top_k(logits, int(np.max(rank)) + 1)  # [B, P, R]
  # Rounding never lifts a child above its parent (the selection relies on it).
  log_q = jnp.minimum(values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), 0.0)
  slot = np.array([column[int(tree.parent[c])] for c in children]) if logits.shape[1] > 1 else (
      np.zeros(children.shape, np.int64))
  tokens = token_ids(index[:, slot, rank]).astype(jnp.int32)  # [B, C]
  scores = drafts.scores[:, tree.parent[children]] + log_q[:, slot, rank]
  return TreeDrafts(tokens=drafts.tokens.at[:, children].set(tokens),
                    scores=drafts.scores.at[:, children].set(scores.astype(jnp.float32)))


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
