"""N-gram drafts: the training corpus's most frequent continuation of the text's last tokens.

A chain of `length` tokens, each the most frequent token that followed the previous two in
the training split of the model's corpus (a trigram table), or, for a pair the corpus never
showed, the most frequent token after the previous one (a bigram table). It needs no heads and
no training: a drafter for any model whose tokenizer saw that corpus, beside prompt lookup
(which copies the text's own repetitions, where this one knows the corpus's habits: `self.`,
`return`, closing brackets).

The tables are counted once per corpus and tokenizer and kept in the measurement cache
(`measurements.py`); inside the loop they are arrays (the drafter's data), hashed: [H] keys and
their continuations, H a power of two, a pair's slot `hash(a, b) mod H`, first come (most
frequent) first served.

This module is also the proof that a drafter is one module: the loop, the engine, the server
and the export took no change for it, and the plan one registry line (`plan.DRAFTERS`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import drafters
from mtp.decode import measurements
from mtp.decode import trees as trees_lib

Array = jax.Array
DEFAULT_LENGTH = 4
# Trigram pairs kept at most (the hash table's size is the next power of two above twice them).
MAX_PAIRS = 1 << 20
# Tokens of the corpus counted at most (the standard library is about 3M).
MAX_TOKENS = 50_000_000


@flax.struct.dataclass
class Tables:
  """bigram: [V] the most frequent token after each id (its own id where none followed);
  pair_a, pair_b: [H] each slot's pair (-1: empty); pair_next: [H] the pair's most frequent
  continuation."""
  bigram: Array
  pair_a: Array
  pair_b: Array
  pair_next: Array


@flax.struct.dataclass
class State:
  """drafts: [B, L]; previous: [B] the token before the newest; newest: [B]."""
  drafts: Array
  previous: Array
  newest: Array


def _slot(a, b, size: int):
  """The hash slot of pair (a, b) in a table of `size` (a power of two); numpy or jnp."""
  xp = jnp if isinstance(a, jax.Array) else np
  a, b = xp.asarray(a).astype(xp.uint32), xp.asarray(b).astype(xp.uint32)
  mixed = a * xp.uint32(2654435761) ^ (b + xp.uint32(0x9E3779B9)) * xp.uint32(40503)
  return (mixed & xp.uint32(size - 1)).astype(xp.int32)


def count_tables(tokens: np.ndarray, vocab_size: int, max_pairs: int = MAX_PAIRS) -> Tables:
  """The tables of a token stream [T] (numpy)."""
  tokens = np.asarray(tokens, np.int64).reshape(-1)
  v = np.int64(vocab_size)
  bigram = np.arange(vocab_size, dtype=np.int32)
  if tokens.size >= 2:
    pairs, counts = np.unique(tokens[:-1] * v + tokens[1:], return_counts=True)
    first, second = pairs // v, pairs % v
    order = np.lexsort((-counts, first))  # By first token, most frequent continuation first.
    keep = order[np.r_[True, first[order][1:] != first[order][:-1]]]
    bigram[first[keep]] = second[keep]
  size = 2
  a = b = nxt = np.zeros((0,), np.int64)
  if tokens.size >= 3:
    triples, counts = np.unique((tokens[:-2] * v + tokens[1:-1]) * v + tokens[2:],
                                return_counts=True)
    pair, nxt = triples // v, triples % v
    order = np.lexsort((-counts, pair))
    keep = order[np.r_[True, pair[order][1:] != pair[order][:-1]]]
    keep = keep[np.argsort(-counts[keep], kind='stable')][:max_pairs]  # Most frequent first.
    a, b, nxt = pair[keep] // v, pair[keep] % v, nxt[keep]
    while size < 2 * len(keep):
      size *= 2
  table = np.full((3, size), -1, np.int32)
  slots = _slot(a, b, size)
  _, first_in_slot = np.unique(slots, return_index=True)  # The most frequent pair wins a slot.
  chosen = np.sort(first_in_slot)
  table[:, slots[chosen]] = np.stack([a[chosen], b[chosen], nxt[chosen]])
  return Tables(bigram=bigram, pair_a=table[0], pair_b=table[1], pair_next=table[2])


def corpus_tables(config, tokenizer, vocab_size: int, workdir=None) -> Tables:
  """The tables of the training split of `config.data`'s corpus, counted once and cached."""
  from mtp.decode import draft_vocab  # pylint: disable=import-outside-toplevel
  name = 'ngram_tables/' + measurements.digest(
      config.data.to_dict() if hasattr(config.data, 'to_dict') else dict(config.data),
      tokenizer.to_json(), vocab_size, MAX_PAIRS) + '.npy'
  cached = measurements.read_array(name)
  if cached is not None and cached.ndim == 1 and cached.size > vocab_size:
    bigram, rest = cached[:vocab_size], cached[vocab_size:].reshape(3, -1)
    return Tables(bigram=bigram, pair_a=rest[0], pair_b=rest[1], pair_next=rest[2])
  tokens = np.concatenate([np.asarray(t).reshape(-1) for t in draft_vocab.corpus_tokens(
      config, tokenizer, workdir, max_tokens=MAX_TOKENS)] or [np.zeros((0,), np.int32)])
  tables = count_tables(tokens, vocab_size)
  measurements.write_array(name, np.concatenate(
      [tables.bigram, tables.pair_a, tables.pair_b, tables.pair_next]).astype(np.int32))
  return tables


@dataclasses.dataclass(frozen=True)
class NgramDrafter(drafters.Drafter):
  """A chain of `length` n-gram drafts (its data: `Tables`)."""
  length: int = DEFAULT_LENGTH

  @property
  def tree(self) -> trees_lib.Tree:
    return trees_lib.chain_tree(self.length)

  def _chain(self, previous: Array, newest: Array, tables: Tables) -> Array:
    size = tables.pair_a.shape[0]
    drafts = []
    for _ in range(self.length):
      slot = _slot(previous, newest, size)
      known = (tables.pair_a[slot] == previous) & (tables.pair_b[slot] == newest)
      following = jnp.where(known, tables.pair_next[slot], tables.bigram[newest])
      drafts.append(following)
      previous, newest = newest, following
    return jnp.stack(drafts, axis=1).astype(jnp.int32)

  def start(self, prefilled: drafters.Prefilled, data: Tables) -> State:
    before = jnp.take_along_axis(prefilled.prompts, (prefilled.lengths - 1)[:, None], axis=1)[:, 0]
    newest = prefilled.first_token.astype(jnp.int32)
    return State(drafts=self._chain(before, newest, data), previous=before.astype(jnp.int32),
                 newest=newest)

  def update(self, state: State, accepted: drafters.Accepted, data: Tables) -> State:
    n = accepted.num_emitted
    last = jnp.take_along_axis(accepted.emitted, (n - 1)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(accepted.emitted, jnp.maximum(n - 2, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(n >= 2, before, state.newest)
    return State(drafts=self._chain(before, last, data), previous=before, newest=last)

  def drafts(self, state: State) -> Array:
    return state.drafts


def build(options) -> tuple[NgramDrafter, Tables]:
  """The plan's builder (`plan.DRAFTERS['ngram']`): the drafter and its corpus's tables."""
  source = options.source
  if not hasattr(source, 'workdir'):
    raise ValueError('n-gram drafts count the training corpus: give a loaded workdir')
  vocab_size = options.cfg.trunk.vocab_size
  return NgramDrafter(), corpus_tables(source.config, source.tokenizer, vocab_size,
                                       source.workdir)
