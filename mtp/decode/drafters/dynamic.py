"""The model's MTP heads draft a dynamic tree (EAGLE-2): each step and row, the `budget` nodes
of a larger superset whose drafts the heads themselves find most probable
(`dynamic_trees.select`), by the path scores of their drafts of every superset node
(`MTPModel.draft_tree`: per node for EAGLE, by depth for the other families). The block
keeps a fixed size, so shapes stay static; which nodes it holds, and so their parents and
attention mask, is per-row state (`row_trees`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import drafters
from mtp.decode import dynamic_trees
from mtp.decode import trees as trees_lib
from mtp.model import heads as heads_lib

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
  def head_nodes(self) -> trees_lib.Tree:
    return self.superset

  @property
  def head_budget(self) -> int:
    return self.budget

  @property
  def vocab_size(self) -> int:
    return self.draft_vocab

  @property
  def dynamic(self) -> bool:
    return True

  def _choose(self, head_drafts: heads_lib.TreeDrafts) -> State:
    chosen = dynamic_trees.select(head_drafts.scores, self.budget)
    return State(drafts=jnp.take_along_axis(head_drafts.tokens, chosen, axis=1)[:, 1:],
                 nodes=chosen)

  def start(self, prefilled: drafters.Prefilled, data) -> State:
    del data
    return self._choose(prefilled.head_drafts)

  def update(self, state: State, accepted: drafters.Accepted, data) -> State:
    del data
    if accepted.head_drafts is None:
      return state
    return self._choose(accepted.head_drafts)

  def drafts(self, state: State) -> Array:
    return state.drafts

  def row_trees(self, state: State) -> dynamic_trees.RowTrees:
    return dynamic_trees.row_trees(self.superset, state.nodes)
