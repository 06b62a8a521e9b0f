"""The 'auto' decoder's measurement: what one drafting step costs, in one-token steps, here.

Speculative decoding pays when a step emits more tokens than it costs one-token steps: its
break-even is seconds per drafting step / seconds per one-token step, for this hardware, model,
batch size, block and prompt width. It covers everything a step does (the verification pass,
the heads' drafting, acceptance, cache bookkeeping), unlike the verification-only cost curve
of `cost_model`, and it is measured on the very compiled loop that then decodes: an 'auto'
request holds both kinds of step (`DecodeRequest.fallback`), so measuring compiles nothing
extra. The loop stops drafting once its tokens per step fall below the break-even, checked
after a probe of a few steps (`probe_steps`: as many as keep the worst case, every draft
rejected, within 5% of the call's one-token steps), and tries it again for one step now and
then (`driver.LoopState`: each retry's worst case within half that budget of the steps since).

A tree with a lookup chain has two kinds of drafting step (`driver.LoopState`): the whole
block where the lookup drafts look likely to pass, the heads' block elsewhere. Each has its
own break-even (`heads_only`) and stops on its own.

Measured once and cached in a JSON file (`break_even.json` beside `cost_model`'s step costs,
`$MTP_CACHE_DIR` or ~/.cache/mtp), keyed by device kind, model shape and request.
"""

from __future__ import annotations

import hashlib
import os

import jax

from mtp.decode import cost_model
from mtp.decode import driver
from mtp.decode import request as request_lib

_FILE_NAME = 'break_even.json'
# Bumped when the decode loop's steps change cost (the two kinds of drafting step, the KV
# cache's layout, fused projections) or the way they are timed, so that older measurements
# are not reused.
_LOOP_VERSION = 4


def cache_key(model, request: request_lib.DecodeRequest, batch_size: int,
              prompt_width: int, heads_only: bool = False) -> str:
  """Everything that changes the ratio: device, model shape, batch, block, sampling, width."""
  tree = request.tree
  shape = (tree.choices, tree.lookup_depth) + ((request.tree_budget,) if request.tree_budget
                                               else ())
  block = hashlib.sha1(repr(shape).encode()).hexdigest()[:10]
  sampling = ('greedy' if request.greedy else
              f't{request.temperature:g}-k{request.top_k}-p{request.top_p:g}')
  return (f'v{_LOOP_VERSION}|{cost_model.device_kind()}|{cost_model.model_key(model)}'
          f'|B{batch_size}'
          f'|P{prompt_width}|N{request.block_size}-{block}|{sampling}'
          f'|new{request.max_new_tokens}|{"rows" if request.row_mapped else "batch"}'
          f'|mesh{request.mesh.shape if request.mesh is not None else None}'
          f'{"|heads" if heads_only else ""}|V{request.draft_vocab_size}')


def break_even(model, prompts, prompt_lengths, request: request_lib.DecodeRequest, *,
               cache_dir: str | None = None, refresh: bool = False, steps: int = 16,
               repeats: int = 5, heads_only: bool = False) -> float:
  """Seconds per drafting step / seconds per one-token step of `request` on `prompts`.

  Args:
    model: an `MTPModel` or `state.PreparedModel`.
    prompts: [B, P] int32, right-padded, checked; prompt_lengths: [B].
    request: an 'auto' request (`request.fallback`).
    cache_dir: where the cache file lives (default `cost_model.default_cache_dir()`).
    refresh: measure again even when cached.
    steps, repeats: loop steps per timed run, and timed runs of each kind (the fastest
      counts).
    heads_only: a request with a lookup chain: the heads' block alone (the loop's other kind
      of drafting step, `driver.LoopState`); else the whole block.

  Returns:
    The break-even in tokens per step (>= 0; a ratio below 1 means drafting costs nothing).
  """
  if not request.fallback:
    raise ValueError('break_even needs an \'auto\' request that drafts (request.fallback)')
  b, p = jax.numpy.shape(prompts)
  key = cache_key(model, request, b, p, heads_only)
  path = os.path.join(cache_dir or cost_model.default_cache_dir(), _FILE_NAME)
  table = cost_model.read_table(path)
  cached = table.get(key)
  if not refresh and isinstance(cached, dict) and _valid(cached.get('break_even')):
    return float(cached['break_even'])
  def timed(drafting: bool, warm_up: bool = False) -> float:
    return driver.seconds_per_step(model, prompts, prompt_lengths, request, drafting=drafting,
                                   heads_only=heads_only and drafting, steps=steps,
                                   repeats=1, warm_up=warm_up)

  timed(True, warm_up=True)  # Compiles (the decode that follows reuses it).
  # The two kinds take turns, and the fastest run of each counts: load from other work only
  # ever adds time. (The median of per-pair ratios, used before, read 1.25 for a heads' block
  # whose fastest runs cost 2.0 one-token steps, on a busy machine: drafting then ran where
  # it lost.)
  pairs = [(timed(True), timed(False)) for _ in range(repeats)]
  drafting, one_token = min(d for d, _ in pairs), min(o for _, o in pairs)
  ratio = drafting / one_token
  table = cost_model.read_table(path)  # Another process may have written meanwhile.
  table[key] = {'break_even': ratio,
                'seconds_per_step': {'drafting': drafting, 'one_token': one_token},
                'ratios': [d / o for d, o in pairs]}
  try:
    cost_model.write_table(path, table)
  except OSError:
    pass  # A read-only cache directory: measure again next time.
  return ratio


def _valid(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6


# A lookup step accepts all of its drafts or none far more often than a heads' step: judged on
# fewer steps than this, lookup on the demo model's validation-split code (which pays, 6 tokens
# a step) was mostly stopped by its first unlucky step.
LOOKUP_LEAST_PROBE = 4


def probe_steps(break_even: float, max_new_tokens: int, *,
                budget: float = request_lib.FALLBACK_BUDGET,
                most: int = 8, least: int = 1) -> int:
  """Drafting steps before the first check, so that their worst case costs at most `budget`.

  A probe step whose drafts are all rejected emits one token at `break_even` one-token steps:
  it loses break_even - 1. Up to `most` steps (acceptance is noisy over fewer), at least
  `least` (which then bounds the worst case instead of the budget).
  """
  if break_even <= 1:
    return most  # Drafting costs no more than a one-token step: probing loses nothing.
  return int(max(least, min(most, budget * max_new_tokens // (break_even - 1))))
