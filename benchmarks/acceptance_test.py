"""Tokens per step and per-depth acceptance read off generations' accepted-length histograms."""

import types

import pytest

from benchmarks import acceptance


def _generation(histogram, tokens):
  return types.SimpleNamespace(num_steps=sum(histogram), accepted_histogram=histogram,
                               tokens=tokens)


def test_depth_d_counts_the_steps_that_emitted_more_than_d_tokens():
  # Entry j counts the steps that emitted j tokens (at most 1 + 2 drafts here).
  ours = [_generation([0, 2, 1, 1], [1, 2]), _generation([0, 3, 1, 0], [3])]
  figures = acceptance.chain_figures(ours, [_generation([], [1, 2]), _generation([], [3])])
  assert figures['steps'] == 8 and figures['tokens'] == 2 + 2 + 3 + 3 + 2
  assert figures['accepted_at_depth'] == [3 / 8, 1 / 8]
  assert figures['tokens_per_step'] == pytest.approx(1 + 3 / 8 + 1 / 8)
  assert figures['exact']
  assert not acceptance.chain_figures(ours, [_generation([], [1, 2]),
                                             _generation([], [4])])['exact']
