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
  """
  name: str
  drafts: bool
  steps_per_chunk: int
  summary: str
  adaptive: bool = False


_REGISTRY = (
    Decoder('auto', drafts=True, adaptive=True, steps_per_chunk=4,
            summary='speculative decoding that stops drafting, for the rest of the call, once '
            'it stops paying: when the tokens accepted per step fall below the measured cost of '
            'a drafting step on this hardware (exact, as speculative)'),
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


def get(name: str) -> Decoder:
  """The decoder called `name`; ValueError listing the registered names otherwise."""
  try:
    return DECODERS[name]
  except (KeyError, TypeError):
    raise ValueError(f'decoder must be one of {", ".join(NAMES)}, got {name!r}') from None
