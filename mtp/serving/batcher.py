"""Continuous batching over the decode engine, on one worker thread.

Each served decoder has a lane: an `Engine` resolved once at start (`decode.plan.resolve`:
its plan takes any prompt and budget the model's positions allow), one running batch of
`max_batch` rows, and the requests in them. Between chunks of loop steps, finished and
cancelled rows leave (`Engine.evict`) and waiting requests join the free rows at once
(`Engine.insert`): up to half a batch prefilled one by one, more in a prefill of the whole
batch (`_prefills_apart`: a prefill computes every row it is given). A lane with nothing
running starts when `max_batch` requests wait or the first has waited `max_wait_ms`. Lanes take
turns, one chunk each.

Every request's settings are data in its row (temperature, top-p, top-k, its token budget, its
seed and the stop id), so any mix of requests shares one batch, and what the lanes compile at
start (each decoder's prefills of the batch and of one row, splice, placement, loop and stop,
for one batch shape: `warm`) is all the server ever compiles (`engine.compilations()`,
exported as `mtp_compilations_total`).

Exactness: in `exact` mode (the default) a greedy request returns `launch.generate`'s tokens,
whatever shares its batch and whenever it joined: every row computes what a batch of one
computes, bit for bit (the prefill in fixed chunks and the cache's chunked attention make prompt
padding and cache size irrelevant). In half precision on CPU the model's products are
row-invariant and its sums run in a fixed order (`model/products.py`), so rows share one batch
and its matmuls (SmolLM2 in bfloat16, 4 rows: 2.2x the tokens/s of rows mapped one by one under
`auto`, 3.1x autoregressive). Elsewhere (float32, GPUs) rows are mapped one by one
(`decode/row_mapped.py`), and under `auto` exact up to float ties where its batch's step kinds
differ from a batch of one's. A sampled request's tokens follow from its prompt, settings and
seed (`decode/settings.py`), never from its neighbours. Without `exact`, rows always share
matmuls (faster for big models; in float32 equal up to float ties).

Results go back to the event loop through `Job.emit` (thread-safe).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import secrets
import threading
import time
from typing import Callable, Sequence

import numpy as np

from mtp.decode import decoders as decoders_lib
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.decode import streaming
from mtp.model import products
from mtp.serving import schemas

# Loop steps per host round trip of a full batch no row of which streams, whatever its decoder:
# at 4 (the drafting decoders' streaming default) `auto` served 32 clients of the demo model a
# third slower than `autoregressive` at 16; at 16 both, equally.
STEPS_PER_CHUNK = 16
# The same while a row is free: requests join between chunks, so one that arrives mid-chunk
# waits for the chunk's end (at 16 steps, about a second of SmolLM2 on 2 CPU cores).
STEPS_WHILE_A_ROW_IS_FREE = 4
# Prompts that `auto` times its break-evens on at start: a typical context, not the longest.
_CALIBRATION_TOKENS = 256


def _chunk_steps(streams: bool, row_free: bool, steps_per_chunk: int | None) -> int:
  """Loop steps in a batch's next chunk: one while a row streams (a stream shows every
  verification step), else `steps_per_chunk` if set, else fewer while a row is free, so that a
  request arriving mid-chunk joins sooner."""
  if streams:
    return 1
  return steps_per_chunk or (STEPS_WHILE_A_ROW_IS_FREE if row_free else STEPS_PER_CHUNK)


def _prefills_apart(joining: int, max_batch: int) -> bool:
  """Whether `joining` rows that join a running batch are prefilled one by one, not in a
  prefill of the whole batch: a prefill computes every row it is given, and a batch's products
  cost less per row (SmolLM2's demo drafter in bfloat16, 128-token prompts: 150-182 ms for one
  row alone, 423 ms for a batch of 4 whatever joins it; so two rows one by one cost less, four
  cost more)."""
  return 0 < joining <= max_batch // 2


class QueueFull(Exception):
  pass


@dataclasses.dataclass
class Event:
  """What the decode thread tells a request.

  kind: 'delta' (text and the tokens of one chunk, with the step's numbers and, when asked,
  their logprobs), 'done' (finish reason and usage) or 'error' (status and message). index:
  the choice it belongs to (n > 1).
  """
  kind: str
  index: int = 0
  text: str = ''
  tokens: tuple[int, ...] = ()
  step: int = 0
  logprobs: dict | None = None
  finish_reason: str | None = None
  usage: dict | None = None
  all_tokens: tuple[int, ...] = ()
  status: int = 500
  message: str = ''


@dataclasses.dataclass
class Job:
  """One row of a request inside the batcher (a request with n > 1 is n jobs).

  Attributes:
    ids: the prompt's token ids.
    options: what the request asked.
    emit: called with each `Event` (from the decode thread).
    prompt: the prompt's text.
    index: the choice this row makes (0 .. n - 1): its seed is folded with it.
    seed: the request's seed (drawn by the app when the request gave none).
  """
  ids: list[int]
  options: schemas.Options
  emit: Callable[[Event], None]
  prompt: str = ''
  index: int = 0
  seed: int = 0
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


def fresh_seed() -> int:
  """A seed for a request that gave none."""
  return secrets.randbits(63)


class _StopText:
  """Stop sequences over streamed text: holds back what could still become one, across chunk
  boundaries."""

  def __init__(self, stops: tuple[str, ...]):
    self.stops, self.text, self.sent = stops, '', 0
    self.hold = max((len(s) for s in stops), default=1) - 1

  def push(self, piece: str, final: bool) -> tuple[str, bool]:
    """(text now safe to send, whether a stop sequence ended the text)."""
    self.text += piece
    if self.stops:
      hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
      if hits:
        out = self.text[self.sent:min(hits)]
        self.sent = len(self.text)
        return out, True
    end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
    out, self.sent = self.text[self.sent:end], end
    return out, False


class _Row:
  """A job's progress within its lane."""

  def __init__(self, job: Job, tokenizer):
    self.job = job
    self.stream = streaming.TextStream(tokenizer)
    self.stop = _StopText(job.options.stop)
    self.count = 0  # Tokens consumed so far.
    self.text_length = 0  # Characters sent (the text offset of the next logprobs).
    self.finished = False
    self.first_token_at = None


class _Lane:
  """One decoder's engine, its running batch and its waiting jobs."""

  def __init__(self, decoder: str, engine, size: int):
    self.decoder, self.engine = decoder, engine
    self.state = None
    self.rows: list[_Row | None] = [None] * size
    self.pending: collections.deque[Job] = collections.deque()

  @property
  def live(self) -> list[_Row]:
    return [r for r in self.rows if r is not None and not r.finished]

  def free(self) -> list[int]:
    # A finished row's slot is free at once: joining overwrites the whole row.
    return [i for i, r in enumerate(self.rows) if r is None or r.finished]


class Batcher:
  """Owns the decode thread; `submit` is called from the event loop.

  Args:
    loaded: the `LoadedModel` to serve.
    decoders: the decoders requests may name (each a lane).
    max_batch: rows per lane.
    max_wait_ms: how long a lane with nothing running waits for company.
    max_queue: jobs waiting at most (more: `QueueFull`).
    exact: every row decodes a batch of one's tokens: rows share the batch where the products
      are row-invariant, else they are mapped one by one (`row_mapped`; the module docstring).
    steps_per_chunk: loop steps between host round trips for batches no row of which streams
      (None: `STEPS_PER_CHUNK`, `STEPS_WHILE_A_ROW_IS_FREE` while a row is free); streaming
      rows get one step per chunk.
    tree, tree_budget: the drafting decoders' heads' tree (`plan.resolve`'s options).
    max_logprobs: alternatives per token a request may ask for (-1: no logprobs at all).
  """

  def __init__(self, loaded, *, decoders: Sequence[str] = (decoders_lib.DEFAULT,),
               max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256,
               exact: bool = True, steps_per_chunk: int | None = None, metrics=None,
               tree=None, tree_budget: int | None = None,
               max_logprobs: int = schemas.MAX_LOGPROBS):
    self.loaded = loaded
    self.tokenizer = loaded.tokenizer
    self.model_cfg = loaded.model.cfg
    self.decoders = tuple(decoders)
    self.max_batch, self.max_wait = int(max_batch), max_wait_ms / 1000
    self.max_queue, self.exact = int(max_queue), exact
    # A row of a shared batch computes a batch of one's bits where products are row-invariant.
    self.row_mapped = exact and not products.on_fast_path(self.model_cfg.trunk.dtype)
    self.steps_per_chunk = steps_per_chunk
    self.metrics = metrics
    self.max_logprobs = int(max_logprobs)
    trunk = self.model_cfg.trunk
    self.max_tokens = trunk.max_seq_len - 1  # Any budget the model's positions allow.
    self.prompt_width = plan_lib.padded_width(trunk.max_seq_len - 1)
    self._options = dict(tree=tree, tree_budget=tree_budget)
    self.fault: Callable[[list[Job]], None] | None = None  # Tests inject failures here.
    self.warm = threading.Event()
    self.compiled: list[str] = []  # What warm-up compiled, for the log and /health.
    self._intake: queue.Queue[Job] = queue.Queue()
    self._lanes: dict[str, _Lane] = {}
    self._waiting = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name='mtp-decode', daemon=True)
    self.startup_error: Exception | None = None
    for decoder in self.decoders:  # A bad option is named here, before anything is served.
      self._resolve(decoder, break_even=0.0)

  def _resolve(self, decoder: str, break_even=None, calibration=None):
    """The lane's engine: its plan takes any prompt and budget the model's positions allow."""
    return plan_lib.resolve(
        self.loaded, decoder, max_new_tokens=self.max_tokens, prompt_width=self.prompt_width,
        # Mapped rows decode as batches of one: trees sized for that.
        batch_size=1 if self.row_mapped else self.max_batch, exact=self.row_mapped,
        continuous=True,
        logprobs=self.max_logprobs, calibration=calibration, break_even=break_even,
        **(self._options if decoders_lib.get(decoder).drafts else {}))

  # ---------------------------------------------------------------- event-loop side

  def start(self) -> None:
    """Starts the thread: it resolves and compiles every lane, then serves."""
    self._thread.start()

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)

  @property
  def queue_depth(self) -> int:
    """Jobs waiting for a row."""
    return self._waiting

  @property
  def active_rows(self) -> int:
    return sum(len(lane.live) for lane in list(self._lanes.values()))

  def check(self, ids: list[int], options: schemas.Options) -> None:
    """RequestError (400) naming the field of a request the model cannot take, before it is
    queued."""
    trunk = self.model_cfg.trunk
    if not ids:
      raise schemas.RequestError('the prompt encodes to no tokens', param='prompt')
    room = trunk.max_seq_len - len(ids)
    if room < 1:
      raise schemas.RequestError(f'the prompt is {len(ids)} tokens: it leaves no room for a '
                                 f'completion in the model\'s {trunk.max_seq_len} positions',
                                 param='prompt')
    if options.max_tokens > room:
      raise schemas.RequestError(
          f'max_tokens {options.max_tokens} exceeds the room the prompt leaves: {len(ids)} '
          f'prompt tokens + max_tokens must be at most max_seq_len={trunk.max_seq_len}',
          param='max_tokens')
    if options.logprobs is not None and options.logprobs > self.max_logprobs:
      raise schemas.RequestError(f'logprobs asks for {options.logprobs} alternatives; this '
                                 f'server gives at most {max(self.max_logprobs, 0)}',
                                 param='logprobs')
    try:
      self._sampling(Job(ids, options, emit=lambda e: None)).check(trunk.vocab_size)
    except ValueError as e:
      param = next((f for f in ('top_k', 'top_p', 'temperature', 'seed') if f in str(e)), None)
      raise schemas.RequestError(str(e), param=param) from None

  def submit(self, job: Job) -> None:
    with self._lock:
      if self._waiting >= self.max_queue:
        raise QueueFull(f'the queue is full ({self.max_queue} requests wait for a batch)')
      self._waiting += 1
    self._intake.put(job)

  # ---------------------------------------------------------------- decode thread

  def _sampling(self, job: Job) -> settings_lib.Sampling:
    o = job.options
    eos = self.tokenizer.eos_id
    return settings_lib.Sampling(max_tokens=o.max_tokens, temperature=o.temperature,
                                 top_k=o.top_k, top_p=o.top_p, seed=job.seed,
                                 stop_ids=() if eos is None else (eos,))

  def _loop(self) -> None:
    try:
      self._warm_up()
    except Exception as e:  # noqa: BLE001  Without its lanes the server cannot decode.
      logging.exception('warm-up failed')
      self.startup_error = e
    self.warm.set()
    while not self._stop.is_set():
      idle = not any(lane.live or lane.pending for lane in self._lanes.values())
      self._take_arrivals(block=idle)
      for lane in list(self._lanes.values()):
        self._admit(lane)
        self._advance(lane)

  def _warm_up(self) -> None:
    """Resolves every lane's engine and compiles all it will run: the batch's prefill and a
    row's, a splice, a placement, a loop step, a stop."""
    trunk = self.model_cfg.trunk
    width = min(_CALIBRATION_TOKENS, trunk.max_seq_len // 2)
    calibration = (np.random.default_rng(0).integers(
        0, self.tokenizer.vocab_size, (self.max_batch, width), np.int32),
                   np.full((self.max_batch,), width, np.int32))
    for decoder in self.decoders:
      engine = self._resolve(decoder, calibration=calibration)
      lane = _Lane(decoder, engine, self.max_batch)
      job = Job([self.tokenizer.bos_id or 0], schemas.Options(max_tokens=2, decoder=decoder),
                emit=lambda e: None)
      prompts, lengths, settings, rows = self._layout(lane, [job], [0])
      fresh = engine.prefill(prompts, lengths, settings, rows)
      state = engine.insert(engine.prefill(prompts, lengths, settings, rows), fresh, rows)
      if _prefills_apart(1, self.max_batch):  # A row joining alone, prefilled alone.
        prompts, lengths, settings, _ = self._layout(lane, [job], [0], size=1)
        state = engine.insert(state, engine.prefill(prompts, lengths, settings), rows)
      state = engine.evict(engine.step(state, 1), rows)
      engine.result(state)
      self._lanes[decoder] = lane
      self.compiled.append(f'{decoder}: batch {self.max_batch}, prompts up to '
                           f'{self.prompt_width} tokens, budgets up to {self.max_tokens}')
    logging.info('compiled %s', '; '.join(self.compiled))

  def _take_arrivals(self, block: bool) -> None:
    """Moves arrived jobs to their lane; blocks (briefly) when there is nothing to do."""
    try:
      job = self._intake.get(timeout=0.1) if block else self._intake.get_nowait()
    except queue.Empty:
      return
    while True:
      lane = self._lanes.get(job.options.decoder)
      if lane is None:
        self._dequeued(1)
        self._fail([job], RuntimeError(self.startup_error or
                                       f'the decoder {job.options.decoder} is not served'))
      else:
        lane.pending.append(job)
      try:
        job = self._intake.get_nowait()
      except queue.Empty:
        return

  def _admit(self, lane: _Lane) -> None:
    """Waiting jobs join free rows at once; a lane with nothing running first waits at most
    max_wait_ms for company."""
    if not lane.pending or not lane.free():
      return
    if not lane.live and len(lane.pending) < self.max_batch:
      waited = time.perf_counter() - lane.pending[0].arrived
      if waited < self.max_wait:
        if any(other.live for other in self._lanes.values()):
          return  # Others decode meanwhile; look again after their next chunk.
        time.sleep(self.max_wait - waited)
        self._take_arrivals(block=False)
    slots = lane.free()
    jobs = []
    while lane.pending and len(jobs) < len(slots):
      job = lane.pending.popleft()
      self._dequeued(1)
      if job.cancelled.is_set():
        self._count(cancelled=1)
      else:
        jobs.append(job)
    if jobs:
      self._join(lane, jobs, slots[:len(jobs)])

  def _dequeued(self, n: int) -> None:
    with self._lock:
      self._waiting -= n

  def _layout(self, lane: _Lane, jobs: list[Job], slots: list[int], size: int | None = None):
    """Prompts [size, W] (size: by default the batch's), lengths, settings and the rows
    joined; other rows hold a filler."""
    size, width = size or self.max_batch, self.prompt_width
    prompts = np.full((size, width), self.tokenizer.pad_id or 0, np.int32)
    lengths = np.ones(size, np.int32)
    samplings = [settings_lib.Sampling(max_tokens=1)] * size
    indices = [0] * size
    rows = np.zeros(size, bool)
    for slot, job in zip(slots, jobs):
      prompts[slot, :len(job.ids)] = job.ids
      lengths[slot], rows[slot] = len(job.ids), True
      samplings[slot], indices[slot] = self._sampling(job), job.index
    return prompts, lengths, lane.engine.settings(samplings, indices), rows

  def _join(self, lane: _Lane, jobs: list[Job], slots: list[int]) -> None:
    """Prefills jobs into free rows of `lane`; their first tokens go out at once."""
    try:
      if self.fault is not None:
        self.fault(jobs)
      engine = lane.engine
      if lane.state is not None and _prefills_apart(len(jobs), self.max_batch):
        for slot, job in zip(slots, jobs):
          prompts, lengths, settings, _ = self._layout(lane, [job], [0], size=1)
          lane.state = engine.insert(lane.state, engine.prefill(prompts, lengths, settings),
                                     np.arange(self.max_batch) == slot)
      else:
        prompts, lengths, settings, rows = self._layout(lane, jobs, slots)
        lane.state = engine.insert(lane.state, engine.prefill(prompts, lengths, settings, rows),
                                   rows)
      for slot, job in zip(slots, jobs):
        lane.rows[slot] = _Row(job, self.tokenizer)
      self._count(batches=1, batch_rows=len(jobs), prompt_tokens=sum(len(j.ids) for j in jobs))
      self._emit(lane, engine.result(lane.state, self.tokenizer.pad_id or 0))
    except Exception as e:  # noqa: BLE001  These requests fail, not the server.
      for slot, job in zip(slots, jobs):
        if lane.rows[slot] is not None and lane.rows[slot].job is job:
          lane.rows[slot] = None
      self._fail(jobs, e)

  def _stopped(self, lane: _Lane) -> np.ndarray:
    """[B] rows to stop: free slots, finished rows, rows whose client left (freed now)."""
    mask = np.zeros(len(lane.rows), bool)
    for i, row in enumerate(lane.rows):
      if row is not None and row.job.cancelled.is_set() and not row.finished:
        row.finished = True
        self._count(cancelled=1)
      if row is None or row.finished:
        lane.rows[i] = None
        mask[i] = True
    return mask

  def _advance(self, lane: _Lane) -> None:
    """One chunk of `lane`: its rows' new tokens go out; finished rows leave."""
    if lane.state is None:
      return
    try:
      lane.state = lane.engine.evict(lane.state, self._stopped(lane))
      if not lane.live:
        return
      jobs = [r.job for r in lane.live]
      if self.fault is not None:
        self.fault(jobs)
      steps = _chunk_steps(any(j.options.stream for j in jobs), bool(lane.free()),
                           self.steps_per_chunk)
      # A chunk ends where a row ends: its answer goes out and its row is free at once.
      lane.state = lane.engine.step(lane.state, steps, until_a_row_ends=True)
      self._emit(lane, lane.engine.result(lane.state, self.tokenizer.pad_id or 0))
    except Exception as e:  # noqa: BLE001  One batch fails, not the server.
      failed = [r.job for r in lane.live]
      lane.state, lane.rows = None, [None] * self.max_batch
      self._fail(failed, e)

  def _emit(self, lane: _Lane, result) -> None:
    for i, row in enumerate(lane.rows):
      if row is not None and not row.finished:
        self._emit_row(row, result, i)

  def _emit_row(self, row: _Row, result, i: int) -> None:
    count = int(result.num_generated[i])
    new = [int(t) for t in result.tokens[i, row.count:count]]
    first = row.count
    row.count = count
    done = bool(result.done[i])
    if new and row.first_token_at is None:
      row.first_token_at = time.perf_counter()
    text = row.stream.push(new) if new else ''
    if done:
      text += row.stream.flush()
    text, stopped = row.stop.push(text, final=done)
    self._count(completion_tokens=len(new))
    job = row.job
    if text or new:
      logprobs = None
      if job.options.logprobs is not None and new:
        k = job.options.logprobs
        logprobs = schemas.logprobs_body(
            self.tokenizer, new, result.logprobs[i, first:count],
            result.top_ids[i, first:count, :k], result.top_logprobs[i, first:count, :k],
            chat=job.options.chat, offset=row.text_length)
      row.text_length += len(text)
      job.emit(Event('delta', index=job.index, text=text, tokens=tuple(new),
                     step=int(result.num_steps[i]), logprobs=logprobs))
    if stopped or done:
      reason = 'stop' if stopped else result.finish_reason(i)
      self._finish(row, result, reason, i)

  def _finish(self, row: _Row, result, reason: str, i: int) -> None:
    row.finished = True
    job = row.job
    count = int(result.num_generated[i])
    tokens = tuple(int(t) for t in result.tokens[i, :count])
    steps = int(result.num_steps[i])
    self._count(verification_steps=steps)
    usage = schemas.usage(len(job.ids), len(tokens), steps,
                          float(np.asarray(result.mean_accepted)[i]))
    if self.metrics is not None:
      self.metrics.observe_latency(
          time.perf_counter() - job.arrived,
          None if row.first_token_at is None else row.first_token_at - job.arrived)
    job.emit(Event('done', index=job.index, finish_reason=reason, usage=usage,
                   all_tokens=tokens))

  def _fail(self, jobs: list[Job], error: Exception) -> None:
    logging.exception('a decode batch failed: %s', error)
    self._count(batch_failures=1)
    for job in jobs:
      job.emit(Event('error', index=job.index, status=500,
                     message=f'the decode batch of this request failed: {error}'))

  def _count(self, **counts) -> None:
    if self.metrics is not None:
      self.metrics.add(**counts)
