"""Self-speculative decoding: the model's heads draft, its trunk verifies (`driver.py`).

Greedy output equals autoregressive output token for token; sampled output has the same
distribution (speculative rejection sampling). `tree` picks the candidates (see
`request.make_request`).
"""

from __future__ import annotations

from typing import Iterator

from mtp.decode import driver

DecodeResult = driver.DecodeResult


def generate(model, prompts, prompt_lengths=None, **kwargs) -> DecodeResult:
  """`driver.generate(..., decoder='speculative')`."""
  return driver.generate(model, prompts, prompt_lengths, decoder='speculative', **kwargs)


def generate_chunks(model, prompts, prompt_lengths=None, **kwargs) -> Iterator[DecodeResult]:
  """`driver.generate_chunks(..., decoder='speculative')`."""
  return driver.generate_chunks(model, prompts, prompt_lengths, decoder='speculative', **kwargs)
