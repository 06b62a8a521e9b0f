"""Prompt-lookup drafts: what followed the last time the text read as it does now.

Self-speculative decoding's heads guess the future from one hidden state; they cannot copy.
Text often repeats itself (code restates its names and patterns, a greedy small model falls
into loops, an answer quotes its prompt), and there the cheapest good draft is a copy: find the
latest earlier occurrence of the text's last n tokens and propose the tokens that followed it
(Saxena's prompt lookup decoding; transformers' `prompt_lookup_num_tokens`). Hung below the
block's root beside the heads' tree, a step accepts whichever of the heads' and the lookup's
paths the trunk agrees with; alone, it drafts for a model without heads (an imported one), the
speedup transformers' prompt lookup gives such a model, without training anything.

The drafter keeps every row's tokens by position (prompt included) and renews its copy after
every step, one-token steps included. Its drafts are `ready` where the key that matched is at
least `min_key` tokens long: longer matches are accepted far more often. Since its drafts are
renewed every step, it checks them against the text in steps that do not verify them
(`drafters.shadow`): `auto` restarts a stopped lookup as soon as they would have paid.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from mtp.decode import drafters
from mtp.decode import trees as trees_lib
from mtp.decode.drafters import shadow as shadow_lib
from mtp.model import kv_cache as kv_cache_lib

Array = jax.Array
# `ready` only where the key matched at least this many tokens. Measured on the demo model's
# greedy continuations of validation-split code (8 prompts, 128 tokens): lookup drafts from
# keys of 0, 1, 2 and 3 tokens had 0.6, 1.4, 2.0 and 5.7 of their 8 tokens accepted on average;
# 1.4 falls short of what 8 extra nodes cost there.
MIN_KEY = 2
# Above this many drafts the verification block alone outgrows any useful size (and XLA compiles
# ever larger programs): far past where verification stops paying on any hardware.
MAX_LENGTH = 64


@flax.struct.dataclass
class State:
  """context: [B, C] every row's tokens by position (later columns stale); drafts: [B, L];
  key_length: [B] the length of the key the drafts matched (0: none); shadow: the drafts
  checked against the text (`evidence`)."""
  context: Array
  drafts: Array
  key_length: Array
  shadow: shadow_lib.Shadow


@dataclasses.dataclass(frozen=True)
class LookupDrafter(drafters.Drafter):
  """A chain of `length` tokens copied from the row's own text, for rows of up to
  `capacity` positions."""
  length: int
  capacity: int
  min_key: int = MIN_KEY

  @property
  def tree(self) -> trees_lib.Tree:
    return trees_lib.chain_tree(self.length)

  @property
  def all_or_nothing(self) -> bool:
    return True

  @property
  def has_evidence(self) -> bool:
    return True

  def start(self, prefilled: drafters.Prefilled, data) -> State:
    b, p = prefilled.prompts.shape
    # Spare columns: a block's writes near the end never clamp (blocks are at most
    # 2 * MAX_LENGTH deep: a lookup chain beside the heads').
    context = jnp.zeros((b, max(self.capacity, p) + 2 * MAX_LENGTH), jnp.int32)
    context = context.at[:, :p].set(prefilled.prompts.astype(jnp.int32))
    context = kv_cache_lib.write_rows(context, prefilled.first_token[:, None], prefilled.lengths)
    drafts, key = propose_with_key(context, prefilled.lengths, self.length)
    return State(context=context, drafts=drafts, key_length=key,
                 shadow=shadow_lib.start(drafts, key >= self.min_key))

  def update(self, state: State, accepted: drafters.Accepted, data) -> State:
    context = kv_cache_lib.write_rows(state.context, accepted.emitted, accepted.lengths + 1)
    drafts, key = propose_with_key(context, accepted.newest, self.length)
    shadow = shadow_lib.update(state.shadow, accepted.emitted, accepted.num_emitted, drafts,
                               key >= self.min_key)
    return State(context=context, drafts=drafts, key_length=key, shadow=shadow)

  def drafts(self, state: State) -> Array:
    return state.drafts

  def ready(self, state: State) -> Array:
    return state.key_length >= self.min_key

  def evidence(self, state: State) -> Array:
    return shadow_lib.evidence(state.shadow)


def propose(context: Array, end: Array, length: int, max_ngram: int = 3) -> Array:
  """Drafts `length` tokens per row by copying from the row's own earlier text.

  `propose_with_key`'s drafts alone.
  """
  return propose_with_key(context, end, length, max_ngram)[0]


def propose_with_key(context: Array, end: Array, length: int, max_ngram: int = 3
                     ) -> tuple[Array, Array]:
  """Drafts `length` tokens per row by copying from the row's own earlier text.

  The key is the row's last n tokens (n = max_ngram, then shorter if it never occurred
  before); the drafts are the tokens after its latest earlier occurrence. Where those run past
  the newest token the match is a repetition with period p (its continuation is the key
  itself), and the drafts continue that period. A row with no match at all repeats its newest
  token (a guess like any other: verification decides).

  Args:
    context: [B, C] int tokens by position; position `end[b]` holds the newest token and later
      positions are ignored.
    end: [B] int position of each row's newest token.
    length: drafts per row.
    max_ngram: longest key tried.

  Returns:
    (drafts [B, length] int32 for positions end + 1 .. end + length, key_length [B] int32:
    the length of the key that matched, 0 for none). Longer matches are accepted far more
    often (the 'auto' decoder verifies lookup drafts only above a key length).
  """
  b, c = context.shape
  context = context.astype(jnp.int32)
  end = end.astype(jnp.int32)
  starts = jnp.arange(c, dtype=jnp.int32)[None, :]
  padded = jnp.pad(context, ((0, 0), (0, max_ngram)), constant_values=-1)
  follow = jnp.full((b,), -1, jnp.int32)  # Position of the first copied token, -1: none yet.
  key_length = jnp.zeros((b,), jnp.int32)
  for n in range(1, max_ngram + 1):  # Longer keys found later take precedence.
    match = (starts + n <= end[:, None]) & (end[:, None] >= n - 1)  # Strictly earlier windows.
    for i in range(n):
      key = jnp.take_along_axis(context, jnp.maximum(end - n + 1 + i, 0)[:, None], axis=1)
      match &= padded[:, i:i + c] == key
    latest = jnp.max(jnp.where(match, starts, -1), axis=1)
    follow = jnp.where(latest >= 0, latest + n, follow)
    key_length = jnp.where(latest >= 0, n, key_length)
  found = follow >= 0
  follow = jnp.where(found, follow, end)
  # Copying past `end` reads the key's own continuation: repeat with period end + 1 - follow.
  period = jnp.maximum(end + 1 - follow, 1)
  offsets = jnp.arange(length, dtype=jnp.int32)[None, :] % period[:, None]
  positions = jnp.where(found[:, None], follow[:, None] + offsets, end[:, None])
  return jnp.take_along_axis(context, jnp.clip(positions, 0, c - 1), axis=1), key_length
