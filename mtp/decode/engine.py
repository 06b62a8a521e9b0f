"""The decode engine: the one door into the decode loop.

An `Engine` holds a model, a decode plan and the plan's data (`plan.resolve` makes one). It
serves offline calls and a server alike, as JetStream's engine does:
  * `generate(prompts, lengths, settings)` decodes a batch; `chunks(...)` yields the partial
    result after the prefill and after each chunk of loop steps (streaming);
  * continuous batching: `prefill` new prompts into a fresh state (of the whole batch, rows
    not named cancelled, or of just the rows that join: a prefill computes every row it is
    given), `insert` its rows into a running state, `step` every running row a chunk of loop
    steps, `evict` rows, read the `result`.
Per-request settings are rows of data (`settings.RowSettings`), never compile keys: a plan
compiles one prefill per prompt width and batch size, one loop and one splice per batch size
(and one placement per number of rows prefilled apart), whatever the requests ask.
`compilations()` counts every program the engines have compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import loop
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib

Array = jax.Array
DecodeResult = state_lib.DecodeResult


class _Compilations:
  """Programs traced (compiled, or read from the persistent cache) since the process started,
  by kind: a public count, where jit's cache sizes are private."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter[str] = collections.Counter()

  def add(self, name: str) -> None:
    with self._lock:
      self._counts[name] += 1

  def total(self) -> int:
    with self._lock:
      return sum(self._counts.values())

  def by_kind(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counts)


COMPILATIONS = _Compilations()
# The settings sampled rows' steps are timed with: top-p below 1 sorts every verified node's
# distribution, which a sampled row's drafting step pays and a greedy row's does not (the demo
# model's heads' block: 2.7 one-token steps sampled, 2.2 greedy).
SAMPLED_TIMING = dict(temperature=1.0, top_p=0.95)


def compilations() -> int:
  """Decoder programs compiled since the process started (a trace is a compilation)."""
  return COMPILATIONS.total()


@functools.partial(jax.jit, static_argnames=('structure', 'plan'))
def _prefill(structure, leaves, data, plan, prompts, lengths, active, settings):
  COMPILATIONS.add('prefill')  # Runs when traced, not when called.
  model = state_lib.merge(structure, leaves)
  return loop.prefill(model, data, plan, prompts, lengths, active, settings)


@functools.partial(jax.jit, static_argnames=('structure', 'plan'), donate_argnames=('state',))
def _run(structure, leaves, data, plan, state, max_steps, until_a_row_ends):
  COMPILATIONS.add('run')
  running = jnp.sum(state.reason == loop.RUNNING)
  least = jnp.where(until_a_row_ends, jnp.maximum(running, 1), 1)
  return loop.run(state_lib.merge(structure, leaves), data, plan, state, max_steps, least)


@functools.partial(jax.jit, donate_argnames=('state',))
def _splice(state, fresh, rows):
  COMPILATIONS.add('splice')
  return loop.splice(state, fresh, rows)


@functools.partial(jax.jit, donate_argnames=('state',))
def _place(state, fresh, slots):
  """`state` [B] with its rows `slots` [N] (distinct) replaced by `fresh`'s N rows, in order
  (every field is per row, as for `loop.splice`)."""
  COMPILATIONS.add('place')
  return jax.tree.map(lambda old, new: old.at[slots].set(new), state, fresh)


# Donated: else the program copies the whole cache to return it unchanged (SmolLM2's 4 rows
# of 8,320 slots: 64-194 ms an eviction).
@functools.partial(jax.jit, donate_argnames=('state',))
def _stop(state, rows):
  COMPILATIONS.add('stop')
  return loop.stop(state, rows)


class Engine:
  """A model, a decode plan and its data, ready to decode (see the module docstring).

  Attributes:
    source: what it was made from (a `LoadedModel`, an `MTPModel` or a `PreparedModel`).
    prepared: the model split for decoding (`state.PreparedModel`).
    plan: the `plan.DecodePlan`.
    data: the plan's `plan_lib.PlanData`.
  """

  def __init__(self, source, plan, data: plan_lib.PlanData):
    self.source = source
    if hasattr(source, 'prepared'):
      self.prepared = source.prepared()  # A LoadedModel keeps its prepared copy.
    else:
      self.prepared = state_lib.prepare(source)
    self.plan, self.data = plan, data

  @property
  def cfg(self):
    """The model's `ModelConfig`."""
    return self.prepared.cfg

  def with_data(self, **changes) -> 'Engine':
    """The same engine with some of its data replaced (same shapes: nothing recompiles)."""
    return Engine(self.source, self.plan, dataclasses.replace(self.data, **changes))

  # ----------------------------------------------------------------------------- requests

  def settings(self, samplings: Sequence[settings_lib.Sampling],
               indices: Sequence[int] | None = None) -> settings_lib.RowSettings:
    """The rows' settings, checked against the plan (errors name the field)."""
    plan = self.plan
    for s in samplings:
      s.check(self.cfg.trunk.vocab_size, plan.max_new_tokens, plan.max_stop_ids)
      if plan.greedy_only and not s.greedy:
        raise ValueError('this decoder was planned for greedy rows only (greedy_only), got '
                         f'temperature {s.temperature}')
    return settings_lib.row_settings(samplings, plan.max_stop_ids, indices)

  def _prompts(self, prompts, lengths, settings, rows=None):
    """Prompts padded to whole prefill chunks, checked against the plan's cache, on the mesh."""
    prompts, lengths = np.asarray(prompts, np.int32), np.asarray(lengths, np.int32)
    b, p = prompts.shape
    width = -(-p // loop.PREFILL_CHUNK) * loop.PREFILL_CHUNK
    active = np.ones(b, bool) if rows is None else np.asarray(rows, bool)
    budgets = np.asarray(settings.max_tokens)
    plan_lib.check_room(lengths[active], budgets[active], self.cfg.trunk.max_seq_len)
    room = self.plan.capacity - self.plan.block_size
    reach = lengths + budgets
    if width > room or np.any(active & (reach > room)):
      raise ValueError(f'prompts of width {p} (padded to {width}) and budgets of up to '
                       f'{int(np.max(np.where(active, reach, 0)))} positions do not fit this '
                       f'decoder\'s cache of {self.plan.capacity} slots (a block takes '
                       f'{self.plan.block_size}): resolve a plan for them')
    if width > p:
      prompts = np.pad(prompts, ((0, 0), (0, width - p)))
    return state_lib.shard_rows((jnp.asarray(prompts), jnp.asarray(lengths),
                                 jnp.asarray(active)), self.plan.mesh)

  # ----------------------------------------------------------------------------- the door

  def prefill(self, prompts, lengths, settings: settings_lib.RowSettings,
              rows=None) -> loop.LoopState:
    """A fresh state: prompts [B, P] (right-padded, checked) prefilled in the rows [B] marked
    (None: all); the other rows are cancelled fillers."""
    prompts, lengths, active = self._prompts(prompts, lengths, settings, rows)
    return _prefill(self.prepared.structure, self.prepared.leaves, self.data, self.plan,
                    prompts, lengths, active, settings)

  def insert(self, state: loop.LoopState | None, fresh: loop.LoopState,
             rows) -> loop.LoopState:
    """The running `state` [B] with the rows `rows` [B] marks taken from `fresh` (None: `fresh`
    itself): `fresh`'s own rows where it has B (a prefill of the whole batch), else its N rows
    in order (a prefill of just the N rows marked: a prefill computes every row it is given)."""
    if state is None:
      return fresh
    rows = np.asarray(rows, bool)
    if fresh.reason.shape[0] == rows.shape[0]:
      return _splice(state, fresh, jnp.asarray(rows))
    slots = np.flatnonzero(rows).astype(np.int32)
    if len(slots) != fresh.reason.shape[0]:
      raise ValueError(f'{len(slots)} rows marked for a fresh state of '
                       f'{fresh.reason.shape[0]} rows')
    return _place(state, fresh, jnp.asarray(slots))

  def step(self, state: loop.LoopState, steps: int, *,
           until_a_row_ends: bool = False) -> loop.LoopState:
    """Up to `steps` loop steps of every running row (`state` is consumed); with
    `until_a_row_ends`, fewer where a row ends before (a server then answers it and fills its
    row at once). Either way one compiled program."""
    return _run(self.prepared.structure, self.prepared.leaves, self.data, self.plan, state,
                jnp.int32(steps), jnp.bool_(until_a_row_ends))

  def evict(self, state: loop.LoopState, rows) -> loop.LoopState:
    """Rows [B] marked stop (cancelled); they cost nothing more when rows are mapped (`state`
    is consumed where a row stops)."""
    rows = np.asarray(rows, bool)
    if not rows.any():
      return state
    return _stop(state, jnp.asarray(rows))

  def result(self, state: loop.LoopState, pad_id: int = 0) -> DecodeResult:
    """Every row's result so far, on the host, `pad_id` after each row's end (only the result's
    fields travel: never the cache)."""
    m = self.plan.max_new_tokens
    fields = (state.tokens[:, :m], state.num_generated, state.num_steps, state.histogram,
              state.reason)
    if self.plan.logprobs >= 0:
      fields += (state.logprobs.chosen[:, :m], state.logprobs.top_ids[:, :m],
                 state.logprobs.top_values[:, :m])
    tokens, n, steps, histogram, reason, *logprobs = (np.asarray(x)
                                                      for x in jax.device_get(fields))
    tokens = np.where(np.arange(m)[None, :] < n[:, None], tokens, pad_id).astype(np.int32)
    out = DecodeResult(tokens=tokens, num_generated=n, num_steps=steps,
                       accepted_histogram=histogram, reason=reason)
    if logprobs:
      out.logprobs, out.top_ids, out.top_logprobs = logprobs
    return out

  def compiled_text(self, state: loop.LoopState) -> dict[str, str]:
    """What XLA runs for states shaped as `state`: {'step', 'evict', 'insert', 'place'} ->
    each program's optimized HLO (to check, say, that none of them copies the cache; 'place'
    inserts one row's prefill)."""
    rows = jnp.ones(state.reason.shape, bool)
    row = jax.tree.map(lambda x: x[:1], state)
    lowered = dict(step=_run.lower(self.prepared.structure, self.prepared.leaves, self.data,
                                   self.plan, state, jnp.int32(1), jnp.bool_(False)),
                   evict=_stop.lower(state, rows), insert=_splice.lower(state, state, rows),
                   place=_place.lower(state, row, jnp.zeros((1,), jnp.int32)))
    return {name: program.compile().as_text() for name, program in lowered.items()}

  def running(self, state: loop.LoopState) -> bool:
    """Whether some row of `state` still decodes."""
    return bool(jnp.any(state.reason == loop.RUNNING))

  # ----------------------------------------------------------------------------- offline

  def generate(self, prompts, lengths, settings: settings_lib.RowSettings, *,
               pad_id: int = 0) -> DecodeResult:
    """Decodes a batch to its end."""
    state = self.prefill(prompts, lengths, settings)
    return self.result(self.step(state, self.plan.max_new_tokens), pad_id)

  def chunks(self, prompts, lengths, settings: settings_lib.RowSettings, *,
             steps_per_chunk: int, pad_id: int = 0,
             stop: Callable[[], np.ndarray | None] | None = None) -> Iterator[DecodeResult]:
    """`generate`, yielding the host result after the prefill and after each chunk of
    `steps_per_chunk` loop steps: one host round trip per chunk, not per token.

    stop: called before each chunk; the [B] bool rows it returns (or None) stop there, as if
      finished (a server's cancelled requests).
    """
    state = self.prefill(prompts, lengths, settings)
    yield self.result(state, pad_id)
    while True:
      stopped = stop() if stop is not None else None
      if stopped is not None:
        state = self.evict(state, stopped)
      if not self.running(state):
        return
      state = self.step(state, steps_per_chunk)
      yield self.result(state, pad_id)

  def decode_function(self) -> Callable:
    """A pure function (model, prompts [B, P], lengths [B], settings) -> the final
    `loop.LoopState`: the prefill and the loop as `generate` runs them, to trace whole
    (`jax.export`; P a multiple of `loop.PREFILL_CHUNK`)."""
    plan, data = self.plan, self.data

    def decode(model, prompts, lengths, settings):
      COMPILATIONS.add('export')
      active = jnp.ones(prompts.shape[:1], bool)
      state = loop.prefill(model, data, plan, prompts, lengths, active, settings)
      return loop.run(model, data, plan, state, jnp.int32(plan.max_new_tokens))
    return decode

  def timing_state(self, prompts, lengths, *, sampled: bool = False) -> loop.LoopState:
    """A state prefilled for timing (`seconds_per_step`'s `prefilled`): these prompts as greedy
    rows (or `sampled`: `SAMPLED_TIMING`'s settings) that never stop at a stop id, each with
    the budget its room allows."""
    room = self.cfg.trunk.max_seq_len - np.asarray(lengths)
    timing = SAMPLED_TIMING if sampled else {}
    samplings = [settings_lib.Sampling(max_tokens=int(min(self.plan.max_new_tokens, r)),
                                       seed=i, **timing) for i, r in enumerate(room)]
    return jax.block_until_ready(self.prefill(prompts, lengths, self.settings(samplings)))

  def seconds_per_step(self, prompts, lengths, *, kind: int, steps: int = 16,
                       overhead: float = 0.0, sampled: bool = False,
                       prefilled: loop.LoopState | None = None) -> float:
    """Wall seconds per loop step of `kind` (0: one-token steps; k: the first k drafters'
    block) on these prompts, greedy (or `sampled`: `SAMPLED_TIMING`'s settings), on the
    compiled loop that decodes (the kind and the settings are data: this compiles nothing
    decoding will not use), less `overhead` per call (`seconds_per_call`). Rows never stop at
    a stop id. `prefilled`: these prompts' `timing_state` (with the same `sampled`), timed
    from a copy, so that timings share one prefill (SmolLM2 at batch 4 prefills 256-token
    prompts in 0.7 s, and copies the state in 16 ms); None: prefilled here."""
    seconds, taken = self._timed_call(prompts, lengths, kind, steps, sampled, prefilled)
    return max(seconds - overhead, 0.0) / max(taken, 1)

  def seconds_per_call(self, prompts, lengths, *,
                       prefilled: loop.LoopState | None = None) -> float:
    """Wall seconds of a call into the loop that runs no step: dispatch and transfers, which a
    call of a few timed steps would otherwise count (3 ms a call, 1 ms a step, at batch 1 for
    the demo model on CPU); a decoding call pays them once. `prefilled`: as
    `seconds_per_step`'s."""
    return self._timed_call(prompts, lengths, 0, 0, prefilled=prefilled)[0]

  def _timed_call(self, prompts, lengths, kind: int, steps: int, sampled: bool = False,
                  prefilled: loop.LoopState | None = None) -> tuple[float, int]:
    if prefilled is None:
      state = self.timing_state(prompts, lengths, sampled=sampled)
    else:  # The loop consumes its state: a copy keeps `prefilled` for the next timing.
      state = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
    engine = self.with_data(force=jnp.int32(kind))
    start = time.perf_counter()
    state = jax.block_until_ready(engine.step(state, steps))
    taken = int(np.max(jax.device_get(state.num_steps)))
    return time.perf_counter() - start, taken
