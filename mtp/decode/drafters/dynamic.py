"""The model's MTP heads draft a dynamic tree (EAGLE-2): each step and row, the `budget` nodes
of a larger superset whose drafts the heads themselves find most probable
(`dynamic_trees.select`). The block keeps a fixed size, so shapes stay static; which nodes it
holds, and so their parents and attention mask, is per-row state (`row_trees`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import drafters
from mtp.decode import dynamic_trees
from mtp.decode import trees as trees_lib
from mtp.decode.drafters import heads

Array = jax.Array


@flax.struct.dataclass
class State:
  """drafts: [B, budget - 1] the chosen nodes' tokens; nodes: [B, budget] the chosen superset
  nodes, ascending, root first."""
  drafts: Array
  nodes: Array


@dataclasses.dataclass(frozen=True)
class DynamicHeadsDrafter(drafters.Drafter):
  """Heads drafting `budget` nodes of `superset` per step (over `draft_vocab` ids, 0: all)."""
  superset: trees_lib.Tree
  budget: int
  draft_vocab: int = 0

  @property
  def tree(self) -> trees_lib.Tree:
    """A stand-in of the block's size and depth bound (each step's structure comes from
    `row_trees`): a chain as deep as a chosen node can be, the other nodes beside it."""
    depth = min(self.superset.max_depth, self.budget - 1)
    return trees_lib.tree_from_choices([(0,) * d for d in range(1, depth + 1)] + [
        (rank,) for rank in range(1, self.budget - depth)])

  @property
  def head_depth(self) -> int:
    return self.superset.head_depth

  @property
  def vocab_size(self) -> int:
    return self.draft_vocab

  @property
  def dynamic(self) -> bool:
    return True

  def _choose(self, head_logits: Array, ids: Array | None) -> State:
    ranks = max(self.superset.topk_per_depth)
    values = jax.lax.top_k(head_logits, ranks)[0]  # [depth, B, R]
    log_probs = values - jax.nn.logsumexp(head_logits, axis=-1, keepdims=True)
    top = heads.candidates(head_logits, ids, ranks)
    nodes = trees_lib.draft_tokens_for_tree(self.superset, top)
    chosen = dynamic_trees.select(self.superset, jnp.transpose(log_probs, (1, 0, 2)),
                                  self.budget)
    return State(drafts=jnp.take_along_axis(nodes, chosen, axis=1)[:, 1:], nodes=chosen)

  def start(self, prefilled: drafters.Prefilled, data) -> State:
    return self._choose(prefilled.head_logits, data)

  def update(self, state: State, accepted: drafters.Accepted, data) -> State:
    if accepted.head_logits is None:
      return state
    return self._choose(accepted.head_logits, data)

  def drafts(self, state: State) -> Array:
    return state.drafts

  def row_trees(self, state: State) -> dynamic_trees.RowTrees:
    return dynamic_trees.row_trees(self.superset, state.nodes)
