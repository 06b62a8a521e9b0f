"""A drafter's evidence from steps that did not verify it: its drafts checked against the text.

A drafter that renews its drafts after every step, one-token steps included (prompt lookup),
proposes a chain whose fate can be read off the tokens the row emits next, at no cost: had its
chain been verified, the trunk would have accepted the drafts up to the first one that differs
from the text, plus its own token (greedy exactly; sampled in expectation too, since a single
draft token x passes rejection sampling with probability p(x), the chance that the row samples
x itself). `auto` stops a kind of step that does not pay and retries it only now and then; where
its drafts would have paid since (text that starts repeating itself), this evidence restarts it
at once instead of after a retry's wait.

A shadow step starts where the drafter is `ready` and ends at the first emitted token that
differs from its chain (or after the whole chain); its tokens are the drafts that matched plus
one. The evidence is the moving average of those tokens over recent shadow steps.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
# Weight of the newest shadow step in the moving average: about the last 7 count.
WEIGHT = 0.25


@flax.struct.dataclass
class Shadow:
  """drafts: [B, L] the chain being checked; matched: [B] its drafts the text matched so far
  (-1: none being checked); mean: [B] tokens per shadow step (NaN: none finished yet)."""
  drafts: Array
  matched: Array
  mean: Array


def start(drafts: Array, ready: Array) -> Shadow:
  """Checks `drafts` [B, L] in `ready` [B] rows from now on."""
  b = drafts.shape[0]
  return Shadow(drafts=drafts.astype(jnp.int32), matched=_fresh(ready),
                mean=jnp.full((b,), jnp.nan, jnp.float32))


def _fresh(ready: Array) -> Array:
  # int32, not weakly typed: the loop's carry keeps one type, or a step would compile twice.
  return jnp.where(ready, 0, -1).astype(jnp.int32)


def update(shadow: Shadow, emitted: Array, num_emitted: Array, drafts: Array,
           ready: Array) -> Shadow:
  """The shadow after a step that emitted `emitted` [B, W] (the first `num_emitted` [B]
  count); `drafts` [B, L] and `ready` [B]: the drafter's chain for the next step."""
  length = shadow.drafts.shape[1]
  width = emitted.shape[1]
  checking = shadow.matched >= 0
  offset = jnp.maximum(shadow.matched, 0)
  columns = jnp.arange(width)[None, :]
  expected = jnp.take_along_axis(shadow.drafts, jnp.minimum(offset[:, None] + columns,
                                                            length - 1), axis=1)
  same = (expected == emitted) & (columns < num_emitted[:, None]) & (
      offset[:, None] + columns < length)
  run = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1)  # [B] matches in a row.
  matched = offset + run
  finished = checking & ((matched >= length) | (run < num_emitted))
  tokens = (jnp.minimum(matched, length) + 1).astype(jnp.float32)
  mean = jnp.where(jnp.isnan(shadow.mean), tokens,
                   (1 - WEIGHT) * shadow.mean + WEIGHT * tokens)
  mean = jnp.where(finished, mean, shadow.mean)
  fresh = ~checking | finished
  return Shadow(drafts=jnp.where(fresh[:, None], drafts.astype(jnp.int32), shadow.drafts),
                matched=jnp.where(fresh, _fresh(ready), matched).astype(jnp.int32),
                mean=mean.astype(jnp.float32))


def evidence(shadow: Shadow) -> Array:
  """[B] tokens per shadow step, counting the chain being checked as if it ended now: at
  least as many of its drafts pass, so this never runs ahead of the average it will become,
  and text that starts repeating itself shows in it while its first chain is still matching."""
  partial = (shadow.matched + 1).astype(jnp.float32)
  blended = jnp.where(jnp.isnan(shadow.mean), partial,
                      (1 - WEIGHT) * shadow.mean + WEIGHT * partial)
  return jnp.where(shadow.matched > 0, blended, shadow.mean)
