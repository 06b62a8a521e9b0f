"""The model's MTP heads draft a static tree: a chain of every head's top-1, or Medusa-style
rank paths (`trees.py`).

The loop runs the heads after each verification, at the newest accepted token
(`MTPModel.draft_logits`, whatever the head family), and hands their logits [depth, B, V] to
`update`; node n then holds head depth(n)'s rank(n) candidate. With a draft vocabulary
(FR-Spec, `draft_vocab.py`) the heads project onto its N ids only, a cheaper step; their
drafts are mapped back to token ids, and verification reads the whole vocabulary, so output
is unchanged. After a one-token step the heads did not run: the old drafts stay (they are only
proposals; verification keeps decoding exact).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import draft_vocab as draft_vocab_lib
from mtp.decode import drafters
from mtp.decode import trees as trees_lib

Array = jax.Array


@flax.struct.dataclass
class State:
  """drafts: [B, N - 1] the tree's nodes' tokens, root excluded."""
  drafts: Array


def candidates(head_logits: Array, ids: Array | None, ranks: int) -> Array:
  """[depth, B, V or M] head logits -> [B, depth, ranks] each head's top token ids, best first
  (`ids`: the draft vocabulary's ids the logits are over, or None)."""
  if ranks == 1:
    top = jnp.argmax(head_logits, axis=-1)[..., None]
  else:
    top = jax.lax.top_k(head_logits, ranks)[1]
  return jnp.transpose(draft_vocab_lib.to_full_ids(top, ids), (1, 0, 2)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class HeadsDrafter(drafters.Drafter):
  """Heads drafting `heads_tree`, over a draft vocabulary of `draft_vocab` ids (0: all)."""
  heads_tree: trees_lib.Tree
  draft_vocab: int = 0

  @property
  def tree(self) -> trees_lib.Tree:
    return self.heads_tree

  @property
  def head_depth(self) -> int:
    return self.heads_tree.head_depth

  @property
  def vocab_size(self) -> int:
    return self.draft_vocab

  def _layout(self, head_logits: Array, ids: Array | None) -> Array:
    top = candidates(head_logits, ids, max(self.heads_tree.topk_per_depth))
    return trees_lib.draft_tokens_for_tree(self.heads_tree, top)[:, 1:]

  def start(self, prefilled: drafters.Prefilled, data) -> State:
    return State(drafts=self._layout(prefilled.head_logits, data))

  def update(self, state: State, accepted: drafters.Accepted, data) -> State:
    if accepted.head_logits is None:
      return state
    return State(drafts=self._layout(accepted.head_logits, data))

  def drafts(self, state: State) -> Array:
    return state.drafts
