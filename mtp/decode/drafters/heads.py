"""The model's MTP heads draft a static tree: a chain of every head's top-1, or Medusa-style
rank paths (`trees.py`).

The loop runs the heads after each verification, at the newest accepted token, and hands
`update` their drafts of every node of the tree (`MTPModel.draft_tree`, whatever the head
family): node n holds the rank(n)-th candidate of the distribution drafted at its parent, by
depth for most families, along the node's own path for EAGLE. With a draft vocabulary
(FR-Spec, `draft_vocab.py`) the heads project onto its N ids only, a cheaper step; their
drafts are token ids all the same, and verification reads the whole vocabulary, so output is
unchanged. After a one-token step the heads did not run: the old drafts stay (they are only
proposals; verification keeps decoding exact).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax

from mtp.decode import drafters
from mtp.decode import trees as trees_lib

Array = jax.Array


@flax.struct.dataclass
class State:
  """drafts: [B, N - 1] the tree's nodes' tokens, root excluded."""
  drafts: Array


@dataclasses.dataclass(frozen=True)
class HeadsDrafter(drafters.Drafter):
  """Heads drafting `heads_tree`, over a draft vocabulary of `draft_vocab` ids (0: all)."""
  heads_tree: trees_lib.Tree
  draft_vocab: int = 0

  @property
  def tree(self) -> trees_lib.Tree:
    return self.heads_tree

  @property
  def head_nodes(self) -> trees_lib.Tree:
    return self.heads_tree

  @property
  def vocab_size(self) -> int:
    return self.draft_vocab

  def start(self, prefilled: drafters.Prefilled, data) -> State:
    del data
    return State(drafts=prefilled.head_drafts.tokens[:, 1:])

  def update(self, state: State, accepted: drafters.Accepted, data) -> State:
    del data
    if accepted.head_drafts is None:
      return state
    return State(drafts=accepted.head_drafts.tokens[:, 1:])

  def drafts(self, state: State) -> Array:
    return state.drafts
