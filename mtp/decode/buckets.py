"""The decoders `mtp.generate` resolves for calls of any shape, and keeps between calls.

A plan's shapes are static: its prompt width and token budget (and the cache capacity they
give) are compiled into its programs and key `auto`'s measurements. Resolved for each call's
exact shapes, a notebook's next prompt, a few tokens longer or with another `max_new_tokens`,
compiled and measured everything again: SmolLM2's demo drafter with `auto` took 41-76 s for
every call after the first on 2 CPU cores, for 64-128 tokens that then decoded in 1-3 s.

So calls resolve plans for shape buckets, powers of two of at least `LEAST` (prompt widths
capped at the model's positions), and each loaded model keeps the engines it resolved
(`LoadedModel.engines`, dropped with its weights). A row decodes the same tokens in any
bucket: the cache's chunked attention reads only the chunks its rows reach
(`kv_cache.attend`), the prefill's chunks follow the longest prompt, not the padding, and each
row stops at its own budget (`settings.Sampling.max_tokens`). What a larger bucket costs is
memory (a cache of at least 2 * LEAST slots, at most twice a long call's); its steps cost the
same within the 3-8% that a block with prompt lookup's chain moves between plans on SmolLM2
(docs/measurements/decoding.md).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

# Prompt widths and token budgets below this share one bucket: a notebook's short prompts and
# budgets compile once. (A prompt width of 256 or more prefills in long chunks too: that
# program, compiled either way for long prompts, then serves short ones at no cost.)
LEAST = 256
# Engines kept per loaded model; the oldest is dropped past this.
MOST_KEPT = 8


def bucket(n: int, least: int = LEAST) -> int:
  """The smallest power of two >= max(n, least, 1) (also `auto`'s measurement keys')."""
  return 1 << (max(int(n), int(least), 1) - 1).bit_length()


def plan_shapes(prompt_width: int, max_new_tokens: int, max_seq_len: int) -> tuple[int, int]:
  """(prompt width, token budget) to resolve a plan for: `prompt_width` (padded) and
  `max_new_tokens` rounded up to their buckets, each kept within the model's `max_seq_len`
  positions where the value itself is."""
  from mtp.decode import plan as plan_lib  # pylint: disable=import-outside-toplevel
  width = plan_lib.padded_width(prompt_width)
  width = min(bucket(width), max(width, plan_lib.padded_width(max_seq_len)))
  return width, min(bucket(max_new_tokens), max(int(max_new_tokens), int(max_seq_len)))


def engine(loaded, decoder: str, *, prompt_width: int, max_new_tokens: int, **options
           ) -> tuple[Any, int, bool]:
  """(an engine for these prompts and budget, the width to pad its prompts to, whether the
  engine was kept from an earlier call: compiled and warm).

  `options` are `plan.resolve`'s (batch_size, greedy_only, calibration, tree, lookup, ...).
  With `capacity` given the plan is resolved for the exact shapes (a capacity sized for them
  may not hold a bucket's), and nothing is kept; options that cannot be compared (arrays other
  than id lists) are resolved afresh too."""
  # Here, not above: the plan imports `auto`, which keys its measurements with `bucket`.
  from mtp.decode import plan as plan_lib  # pylint: disable=import-outside-toplevel
  calibration = options.pop('calibration', None)
  if options.get('capacity') is not None:
    return plan_lib.resolve(loaded, decoder, prompt_width=prompt_width,
                            max_new_tokens=max_new_tokens, calibration=calibration,
                            **options), prompt_width, False
  width, budget = plan_shapes(prompt_width, max_new_tokens, loaded.model.cfg.trunk.max_seq_len)
  key = _key((decoder, width, budget, options))
  kept = loaded.engines() if key is not None else {}
  if key in kept:
    kept[key] = kept.pop(key)  # The newest use last: the oldest is dropped first.
    return kept[key], width, True
  if calibration is not None:  # Timed on the prefill decoding will use, not one of its own.
    prompts, lengths = calibration
    calibration = (np.pad(prompts, ((0, 0), (0, width - np.shape(prompts)[1]))), lengths)
  resolved = plan_lib.resolve(loaded, decoder, prompt_width=width, max_new_tokens=budget,
                              calibration=calibration, **options)
  if key is not None:
    kept[key] = resolved
    while len(kept) > MOST_KEPT:
      kept.pop(next(iter(kept)))
  return resolved, width, False


def _key(value) -> Any:
  """A hashable stand-in for `value` (options as the caller gave them), or None where some
  part of it cannot be compared cheaply."""
  if value is None or isinstance(value, (str, bool, numbers.Number)):
    return value
  if isinstance(value, dict):
    items = [(k, _key(v)) for k, v in sorted(value.items())]
    return None if any(v is None and value[k] is not None for k, v in items) else tuple(items)
  if isinstance(value, (list, tuple)):
    parts = [_key(v) for v in value]
    return None if any(p is None and v is not None for p, v in zip(parts, value)) else (
        type(value).__name__, tuple(parts))
  if isinstance(value, np.ndarray) and value.ndim == 1 and value.size <= 1 << 16:
    return ('array', value.dtype.str, value.tobytes())
  try:
    hash(value)  # A `trees.Tree` hashes by its structure.
  except TypeError:
    return None
  return value
