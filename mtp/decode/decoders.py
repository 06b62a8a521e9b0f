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
  """
  name: str
  drafts: bool
  steps_per_chunk: int
  summary: str
  adaptive: bool = False
  lookup: int = 0


_REGISTRY = (
    # Lookup drafts are verified only where their key promises acceptance (`driver`), so
    # they cost little where the text does not repeat. 8: see `default_lookup`.
    Decoder('auto', drafts=True, adaptive=True, steps_per_chunk=4, lookup=8,
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


def get(name: str) -> Decoder:
  """The decoder called `name`; ValueError listing the registered names otherwise."""
  try:
    return DECODERS[name]
  except (KeyError, TypeError):
    raise ValueError(f'decoder must be one of {", ".join(NAMES)}, got {name!r}') from None
