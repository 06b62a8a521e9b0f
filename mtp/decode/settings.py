"""Per-request decode settings: checked on the host, per-row data inside the loop.

What a request may choose without a new compiled decoder lives here: temperature, top-k,
top-p, its own token budget (`max_tokens`), the ids that end it (`stop_ids`: EOS, a chat
template's end of turn) and its seed. A `Sampling` is one request's choice, checked once where
it enters (`check`, errors name the field); `RowSettings` holds a batch's choices as [B]
arrays in the decode loop's state, so rows with any mix of settings share one batch.

Seeds: row r's randomness is its own PRNG key, `key(seed)` folded with the row's index within
its request (`mtp.generate`'s prompt index, the server's choice index for n > 1), and each loop
step folds in the row's own step count. So a sampled row's tokens depend on its prompt,
settings and seed, not on which rows share its batch or when it joined (the loop's numerics
aside: under the `auto` decoder a row's block shape follows its batch's step kind, which can
move a float tie).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import sampling as sampling_lib

Array = jax.Array
# Seeds may be any integer a client sends (OpenAI's are 64-bit): they are read modulo 2**64.
_SEED_MODULUS = 2 ** 64


@dataclasses.dataclass(frozen=True)
class Sampling:
  """One request's decode settings.

  Attributes:
    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 = greedy; else sample from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = all).
    top_p: nucleus mass in (0, 1] (1 = all).
    seed: the request's seed (any integer).
    stop_ids: token ids that end the row (kept in its output), such as EOS.
  """
  max_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def check(self, vocab_size: int, max_tokens: int | None = None,
            max_stop_ids: int | None = None) -> 'Sampling':
    """Itself, or ValueError naming the field: `max_tokens` above `max_tokens` (the room the
    caller has), a sampling setting out of range, a stop id outside the vocabulary."""
    if (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral)
        or self.max_tokens < 1):
      raise ValueError(f'max_tokens must be a positive integer, got {self.max_tokens!r}')
    if max_tokens is not None and self.max_tokens > max_tokens:
      raise ValueError(f'max_tokens {self.max_tokens} exceeds the {max_tokens} tokens there is '
                       'room for')
    sampling_lib.validate_sampling(self.temperature, self.top_k, self.top_p, vocab_size)
    if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
      raise ValueError(f'seed must be an integer, got {self.seed!r}')
    for i in self.stop_ids:
      if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size:
        raise ValueError(f'stop id {i!r} is outside the vocabulary [0, {vocab_size})')
    if max_stop_ids is not None and len(set(self.stop_ids)) > max_stop_ids:
      raise ValueError(f'at most {max_stop_ids} stop ids, got {len(set(self.stop_ids))}')
    return self


@flax.struct.dataclass
class RowSettings:
  """Every row's settings, as the decode loop reads them.

  Attributes:
    temperature: [B] float32 (0 = greedy).
    top_k: [B] int32 (0 = off).
    top_p: [B] float32 (1 = off).
    max_tokens: [B] int32, each row's budget.
    stop_ids: [B, S] int32, -1 for unused entries.
    key: [B, ...] each row's own PRNG key, as raw key data (`jax.random.key_data`: plain
      arrays go through `where`, donation and export alike).
  """
  temperature: Array
  top_k: Array
  top_p: Array
  max_tokens: Array
  stop_ids: Array
  key: Array


@jax.jit
def _row_keys(seed_low: Array, seed_high: Array, index: Array) -> Array:
  def one(low, high, i):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(low), high), i)
  return jax.random.key_data(jax.vmap(one)(seed_low, seed_high, index))


def row_settings(samplings: Sequence[Sampling], max_stop_ids: int,
                 indices: Sequence[int] | None = None) -> RowSettings:
  """The rows of `samplings` (one per row, checked) as `RowSettings`.

  indices: each row's index within its request (None: 0 for every row); it keeps rows of one
    request with one seed (several prompts, or n > 1) apart.
  """
  b = len(samplings)
  if indices is None:
    indices = [0] * b
  stops = np.full((b, max(max_stop_ids, 1)), -1, np.int32)
  for row, s in enumerate(samplings):
    ids = sorted(set(s.stop_ids))
    if len(ids) > stops.shape[1]:
      raise ValueError(f'at most {max_stop_ids} stop ids, got {len(ids)}')
    stops[row, :len(ids)] = ids
  seeds = np.array([int(s.seed) % _SEED_MODULUS for s in samplings], dtype=object)
  return RowSettings(
      temperature=np.array([s.temperature for s in samplings], np.float32),
      top_k=np.array([s.top_k for s in samplings], np.int32),
      top_p=np.array([s.top_p for s in samplings], np.float32),
      max_tokens=np.array([s.max_tokens for s in samplings], np.int32),
      stop_ids=stops,
      key=_row_keys(np.array([int(x) & 0xFFFFFFFF for x in seeds], np.uint32),
                    np.array([int(x) >> 32 for x in seeds], np.uint32),
                    np.asarray(indices, np.uint32)))


def step_keys(settings: RowSettings, step: Array) -> Array:
  """[B] keys of each row's loop step `step` [B] (0: the prefill)."""
  keys = jax.random.wrap_key_data(settings.key)
  return jax.vmap(jax.random.fold_in)(keys, step.astype(jnp.uint32))

