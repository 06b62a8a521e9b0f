"""Baseline decoding, one token per forward pass: the driver's loop with a root-only tree."""

from __future__ import annotations

from typing import Iterator

from mtp.decode import driver

DecodeResult = driver.DecodeResult


def generate(model, prompts, prompt_lengths=None, **kwargs) -> DecodeResult:
  """`driver.generate(..., decoder='autoregressive')`; the model's heads are not used."""
  return driver.generate(model, prompts, prompt_lengths, decoder='autoregressive', **kwargs)


def generate_chunks(model, prompts, prompt_lengths=None, **kwargs) -> Iterator[DecodeResult]:
  """`driver.generate_chunks(..., decoder='autoregressive')`."""
  return driver.generate_chunks(model, prompts, prompt_lengths, decoder='autoregressive',
                                **kwargs)
