"""Prompt-lookup drafts: what followed the last time the text read as it does now.

Self-speculative decoding's heads guess the future from one hidden state; they cannot copy.
Text often repeats itself (code restates its names and patterns, a greedy small model falls
into loops, an answer quotes its prompt), and there the cheapest good draft is a copy: find the
latest earlier occurrence of the text's last n tokens and propose the tokens that followed it
(Saxena's prompt lookup decoding; transformers' `prompt_lookup_num_tokens`). The decoder hangs
these drafts as one extra chain in its candidate tree (`trees.with_lookup`), so a step accepts
whichever of the heads' and the lookup's paths the trunk agrees with.

Everything here is a pure function of the token buffer, run inside the jitted decode loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


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
