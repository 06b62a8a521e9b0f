"""The decoders, by name: the one registry that the API, streaming and the CLIs read.

Every decoder runs the same loop (`driver.py`): verify a block of candidates with one cached
trunk pass, accept the longest agreeing path plus one token of the trunk's own, draft the next
block. A decoder is only a choice of candidates. Autoregressive decoding is the root-only
case: a block of one token, nothing drafted.

Importing this module is cheap (no JAX), so a launcher can build its flags from it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A registered decoder.

  Attributes:
    name: what users pass as `decoder=` / `--decoder`.
    drafts: whether the model's heads (and prompt lookup) draft candidates; False decodes one
      token per loop step and takes no tree or lookup options.
    adaptive: drafting stops where it does not pay (`DecodeRequest.fallback`): after a few
      steps, if the batch's tokens per step fall below drafting's break-even, measured on this
      hardware (`mtp.decode.auto`); a model without heads decodes autoregressively.
    steps_per_chunk: loop steps per host round trip when streaming, by default.
    summary: one line for help texts.
    lookup: prompt-lookup drafts added to the heads' tree by default when decoding greedily
      (callers that take `lookup=None`: `mtp.generate`, `launch.generate`).
    draft_vocab: the heads draft over this many most frequent ids of the training data by
      default (FR-Spec), for vocabularies of at least `LARGE_VOCAB_FACTOR` times as many ids
      (callers that take `draft_vocab=None`; `default_draft_vocab`); 0: the whole vocabulary.
  """
  name: str
  drafts: bool
  steps_per_chunk: int
  summary: str
  adaptive: bool = False
  lookup: int = 0
  draft_vocab: int = 0


_REGISTRY = (
    # Lookup drafts are verified only where their key promises acceptance (`driver`), so
    # they cost little where the text does not repeat. 8: see `default_lookup`.
    # Drafts over 8,192 ids: see `default_draft_vocab`.
    Decoder('auto', drafts=True, adaptive=True, steps_per_chunk=4, lookup=8, draft_vocab=8192,
            summary='speculative decoding that adapts: greedy, it adds prompt-lookup drafts '
            'where the text repeats; each kind of drafting step stops once its tokens per '
            'step fall below its measured cost on this hardware, and is retried now and then '
            '(exact, as speculative)'),
    Decoder('speculative', drafts=True, steps_per_chunk=4,
            summary='the model\'s heads draft a tree of candidates, its trunk verifies them '
            '(exact: the output is distributed as autoregressive decoding\'s)'),
    Decoder('autoregressive', drafts=False, steps_per_chunk=16,
            summary='one token per forward pass'),
)
DECODERS: dict[str, Decoder] = {d.name: d for d in _REGISTRY}
NAMES: tuple[str, ...] = tuple(DECODERS)
DEFAULT = 'auto'
# Continuous batching (the server) splices requests into running loops, where one call's test
# of whether drafting pays has no meaning: it serves the decoders that are not adaptive.
SERVED: tuple[str, ...] = tuple(d.name for d in _REGISTRY if not d.adaptive)
SERVED_DEFAULT = 'speculative'


def default_lookup(name: str, lookup: int | None, temperature: float, num_heads: int) -> int:
  """`lookup`, or for None the decoder's default: its `lookup` when greedy with heads, else 0
  (lookup drafts are verified greedily only, and hang below a tree of the heads')."""
  if lookup is not None:
    return lookup
  return get(name).lookup if temperature == 0 and num_heads > 0 else 0


# A draft vocabulary is the default only where the whole one is at least this many times larger:
# there the heads' projection onto the whole vocabulary costs as much as a sizeable part of the
# trunk (SmolLM2: 49,152 ids x 576 per drafted token, 113 MB of float32 read), and the N most
# frequent ids still cover most of what the model writes. Measured (`benchmarks.draft_vocab`,
# README): SmolLM2's EAGLE drafter, 'auto' on held-out code at batch 1, 1.33x autoregressive
# speed over all 49,152 ids, 1.48x over 8,192 (97% of its output), 1.46x over 16,384; the
# demo model's 4,096 ids gain nothing from 512-2,048.
LARGE_VOCAB_FACTOR = 4


def default_draft_vocab(name: str, draft_vocab: int | None, vocab_size: int,
                        num_heads: int) -> int:
  """`draft_vocab`, or for None the decoder's default: its `draft_vocab` for a model with heads
  whose vocabulary holds at least `LARGE_VOCAB_FACTOR` times as many ids, else 0 (the whole
  vocabulary). The default never changes the output, only what drafting costs and accepts."""
  if draft_vocab is not None:
    return draft_vocab
  size = get(name).draft_vocab
  if not size or not num_heads or vocab_size < LARGE_VOCAB_FACTOR * size:
    return 0
  return size


def get(name: str) -> Decoder:
  """The decoder called `name`; ValueError listing the registered names otherwise."""
  try:
    return DECODERS[name]
  except (KeyError, TypeError):
    raise ValueError(f'decoder must be one of {", ".join(NAMES)}, got {name!r}') from None
