"""The decoders, by name: the one registry that the API, streaming and the CLIs read.

Every decoder runs the same loop (`loop.py`): verify a block of candidates with one cached
trunk pass, accept the longest agreeing path plus one token of the trunk's own, draft the next
block. A decoder is only a choice of drafters and of a policy (`plan.py` resolves it).
Autoregressive decoding is the root-only case: a block of one token, nothing drafted.

Importing this module is cheap (no JAX), so a launcher can build its flags from it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A registered decoder.

  Attributes:
    name: what users pass as `decoder=` / `--decoder`.
    drafts: whether it drafts candidates; False decodes one token per loop step and takes no
      tree or lookup options.
    steps_per_chunk: loop steps per host round trip when streaming, by default.
    summary: one line for help texts.
    adaptive: drafting stops, row by row, where it does not pay (`mtp.decode.auto`).
    drafters: the drafters it mixes by default, in block order (names of
      `mtp.decode.plan.DRAFTERS`); a model without heads drafts by prompt lookup alone.
    lookup: prompt-lookup drafts per step, where it drafts by lookup (callers that take
      `lookup=None`).
    draft_vocab: the heads draft over this many most frequent ids of the training data by
      default (FR-Spec), for vocabularies of at least `LARGE_VOCAB_FACTOR` times as many ids
      (callers that take `draft_vocab=None`; `default_draft_vocab`); 0: the whole vocabulary.
  """
  name: str
  drafts: bool
  steps_per_chunk: int
  summary: str
  adaptive: bool = False
  drafters: tuple[str, ...] = ()
  lookup: int = 0
  draft_vocab: int = 0


_REGISTRY = (
    # Lookup drafts are verified only where their key promises acceptance, so they cost little
    # where the text does not repeat. 8: see `README` (auto's table). Drafts over 8,192 ids:
    # see `default_draft_vocab`.
    Decoder('auto', drafts=True, adaptive=True, steps_per_chunk=4, drafters=('heads', 'lookup'),
            lookup=8, draft_vocab=8192,
            summary='speculative decoding that adapts: the heads draft, and prompt lookup where '
            'the text repeats; each row stops each kind of drafting step once its tokens per '
            'step fall below the step\'s measured cost on this hardware, and retries it now '
            'and then (exact, as speculative)'),
    Decoder('speculative', drafts=True, steps_per_chunk=4, drafters=('heads',), lookup=8,
            summary='the model\'s heads draft a tree of candidates (prompt lookup, for a model '
            'without heads), its trunk verifies them (exact: the output is distributed as '
            'autoregressive decoding\'s)'),
    Decoder('autoregressive', drafts=False, steps_per_chunk=16,
            summary='one token per forward pass'),
)
DECODERS: dict[str, Decoder] = {d.name: d for d in _REGISTRY}
NAMES: tuple[str, ...] = tuple(DECODERS)
DEFAULT = 'auto'


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
