"""Drafters: where a decode step's candidate tokens come from, one module each.

The decode loop (`mtp.decode.loop`) verifies a block each step: the root (the newest token)
and, hung below it in turn, the nodes of the plan's drafters (`trees.join`). It accepts the
longest path the trunk agrees with, then asks every drafter for the next block's nodes. The
plan (`mtp.decode.plan`) chooses and orders the drafters once; the `auto` policy
(`mtp.decode.auto`) decides per step how many of them the block holds (the first k: the step's
"kind") and per row which of their nodes are candidates.

A drafter is a frozen dataclass (hashable: part of the compiled decoder's identity) that owns
  * `tree`: its subtree, root included (static: the layout of its nodes in a block);
  * its state in the loop: a pytree of per-row arrays ([B, ...]) holding at least its current
    drafts, made by `start` after the prefill and renewed by `update` after every loop step
    (whether or not the step verified its nodes: prompt lookup keeps its text current through
    one-token steps);
  * `drafts(state)`: [B, n] its nodes' tokens for the next block, in its tree's node order;
  * `ready(state)`: [B] whether its drafts look worth verifying (`auto` verifies a drafter's
    nodes only in rows where they are; default: always);
  * `evidence(state)`: [B] the tokens per step its drafts would have made where no step
    verified them, or None (default): `auto` restarts a stopped kind where it says the kind
    pays (prompt lookup checks its chains against the text, `drafters.shadow`).
`start` and `update` also get the drafter's data: arrays the plan made for it (a table, a draft
vocabulary's ids), passed to the compiled loop as arguments, so new data of the same shapes
compiles nothing. Drafters that read the model's MTP heads set `head_nodes`, the static tree
whose every node the heads draft (and `vocab_size`, a draft vocabulary, whose [M] ids are then
their data): the loop runs the heads after each verification and hands their drafts of those
nodes, a token and a path score each, to `update` (`Accepted.head_drafts`,
`MTPModel.draft_tree`). A drafter
whose tree changes per row and step (a dynamic tree) sets `dynamic` and gives
`row_trees(state)`; it verifies alone.

How to add a drafter: write `mtp/decode/drafters/<name>.py` with one frozen dataclass that
subclasses `Drafter` and implements `tree`, `start`, `update` and `drafts` (and `ready` or
`data` if it needs them); `start` gets a `Prefilled` (the prompts, their lengths and first
tokens), `update` an `Accepted` (the tokens each row emitted this step and where they sit), and
both return the drafter's new state, any pytree of [B, ...] arrays. Then add one line to the
plan's `DRAFTERS` registry (`mtp/decode/plan.py`): a function that builds it, and its data,
from the model and the user's options. The loop, the engine, the server and the export need
no change: `ngram.py` was added this way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import dynamic_trees
from mtp.decode import trees as trees_lib
from mtp.model import heads as heads_lib

Array = jax.Array


@flax.struct.dataclass
class Prefilled:
  """What a drafter's `start` reads after the prefill.

  Attributes:
    prompts: [B, P] right-padded prompt tokens.
    lengths: [B] prompt lengths: the first token sits at position `lengths`.
    first_token: [B] the token the prefill chose.
    head_drafts: the MTP heads' drafts below the first token (`heads.TreeDrafts` of the
      heads drafter's `head_nodes`), when a drafter reads the heads; else None.
  """
  prompts: Array
  lengths: Array
  first_token: Array
  head_drafts: heads_lib.TreeDrafts | None = None


@flax.struct.dataclass
class Accepted:
  """What one loop step accepted, as every drafter's `update` reads it.

  Attributes:
    emitted: [B, W] the tokens each row emitted this step, in order (the first
      `num_emitted` count); emitted token j sits at position `lengths + 1 + j`.
    num_emitted: [B] in 1..W.
    lengths: [B] each row's position of the step's root (the newest token before the step).
    head_drafts: the heads' drafts below the newest token (`heads.TreeDrafts` [B, M] of the
      heads drafter's `head_nodes`), in steps that ran the heads (drafting steps of a plan
      whose drafters read them); None in steps that did not (one-token steps): keep the old
      drafts then.
  """
  emitted: Array
  num_emitted: Array
  lengths: Array
  head_drafts: heads_lib.TreeDrafts | None = None

  @property
  def newest(self) -> Array:
    """[B] position of each row's newest token after the step."""
    return self.lengths + self.num_emitted


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The protocol (see the module docstring). Subclasses are frozen dataclasses."""

  @property
  def head_nodes(self) -> trees_lib.Tree | None:
    """The static tree whose every node the MTP heads draft for it (None: it reads no heads)."""
    return None

  @property
  def head_budget(self) -> int | None:
    """Of `head_nodes`, the most it verifies per step, root included, chosen by the heads'
    scores (a dynamic tree's budget); None: every node. The heads may skip drafting nodes
    that cannot be among them."""
    return None

  @property
  def head_depth(self) -> int:
    """MTP heads this drafter reads (0: none)."""
    return 0 if self.head_nodes is None else self.head_nodes.max_depth

  @property
  def vocab_size(self) -> int:
    """The size of the draft vocabulary the heads draft over (0: every id)."""
    return 0

  @property
  def dynamic(self) -> bool:
    """Whether its tree changes per row and step (`row_trees`)."""
    return False

  @property
  def all_or_nothing(self) -> bool:
    """Whether its drafts tend to pass all together or not at all (copies of earlier text):
    `auto` then judges it on a few steps, not one."""
    return False

  @property
  def tree(self) -> trees_lib.Tree:
    """Its subtree, root included."""
    raise NotImplementedError

  @property
  def num_drafts(self) -> int:
    """Nodes it drafts per block (its tree's nodes, root excluded)."""
    return self.tree.num_nodes - 1

  def start(self, prefilled: Prefilled, data: Any) -> Any:
    """Its state after the prefill: the first drafts."""
    raise NotImplementedError

  def update(self, state: Any, accepted: Accepted, data: Any) -> Any:
    """Its state after a loop step: the next drafts."""
    raise NotImplementedError

  def drafts(self, state: Any) -> Array:
    """[B, num_drafts] its nodes' tokens, in its tree's node order."""
    raise NotImplementedError

  def ready(self, state: Any) -> Array:
    """[B] bool: rows whose drafts look worth verifying."""
    return jnp.ones(self.drafts(state).shape[:1], bool)

  @property
  def has_evidence(self) -> bool:
    """Whether it judges its own drafts in steps that do not verify them (`evidence`)."""
    return False

  def evidence(self, state: Any) -> Array | None:
    """[B] float: tokens per step its drafts would have made in recent steps that did not
    verify them, judged from the text the rows emitted (`drafters.shadow`; NaN: not known
    yet), or None where it cannot tell (`has_evidence` False: its drafts are not renewed in
    every step)."""
    return None

  def row_trees(self, state: Any) -> dynamic_trees.RowTrees:
    """Every row's tree for the next block (dynamic drafters only)."""
    raise NotImplementedError


def ready_rows(drafters: tuple[Drafter, ...], states: tuple[Any, ...]) -> Array:
  """[B, K] whether drafter k's drafts look worth verifying in each row."""
  return jnp.stack([d.ready(state) for d, state in zip(drafters, states)], axis=1)


def evidence_rows(drafters: tuple[Drafter, ...], states: tuple[Any, ...]) -> Array:
  """[B, K] drafter k's `evidence` in each row (NaN where it has none)."""
  columns = []
  for d, state in zip(drafters, states):
    e = d.evidence(state)
    b = d.drafts(state).shape[0]
    columns.append(jnp.full((b,), jnp.nan, jnp.float32) if e is None else e.astype(jnp.float32))
  return jnp.stack(columns, axis=1)
