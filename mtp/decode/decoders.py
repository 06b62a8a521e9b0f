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
    steps_per_chunk: loop steps per host round trip when streaming, by default.
    summary: one line for help texts.
  """
  name: str
  drafts: bool
  steps_per_chunk: int
  summary: str


_REGISTRY = (
    Decoder('speculative', drafts=True, steps_per_chunk=4,
            summary='the model\'s heads draft a tree of candidates, its trunk verifies them '
            '(exact: the output is distributed as autoregressive decoding\'s)'),
    Decoder('autoregressive', drafts=False, steps_per_chunk=16,
            summary='one token per forward pass'),
)
DECODERS: dict[str, Decoder] = {d.name: d for d in _REGISTRY}
NAMES: tuple[str, ...] = tuple(DECODERS)
DEFAULT = 'speculative'


def get(name: str) -> Decoder:
  """The decoder called `name`; ValueError listing the registered names otherwise."""
  try:
    return DECODERS[name]
  except (KeyError, TypeError):
    raise ValueError(f'decoder must be one of {", ".join(NAMES)}, got {name!r}') from None
