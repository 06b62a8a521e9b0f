"""Scheduling requests onto the batched decode loop, on one worker thread.

Requests that share a compiled decoder (decoder, prompt width bucket, max_tokens, sampling
settings: a `Key`) are batched: the first one waits at most `max_wait_ms` for company, then a
batch of up to `max_batch` rows starts. Batches of every key run side by side, one chunk of loop
steps each in turn, so a request that arrives while others decode starts within a chunk and
never waits for a running batch to end; finished, stopped and cancelled rows leave between
chunks.

Exactness: in `exact` mode (the default) a batch runs row-mapped (`decode/row_mapped.py`):
every row computes what a batch of one computes, bit for bit, so a greedy request returns
`launch.generate`'s tokens whatever shares its batch. The batch keeps the same prompt width
(`mtp.generate` pads to a multiple of 32) and the same max_tokens, hence the same KV-cache
size, as `launch.generate`: XLA:CPU's attention reductions depend on that size too. A batch is
always `max_batch` rows (missing rows are inactive fillers that cost nothing), so each key
compiles one program.

Results go back to the event loop through `Job.emit` (thread-safe).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import jax
import numpy as np

from mtp.decode import driver
from mtp.decode import request as request_lib
from mtp.decode import state as state_lib
from mtp.decode import streaming
from mtp.serving import schemas

PROMPT_WIDTH_MULTIPLE = 32  # As mtp.generate: the same buckets give the same compiled shapes.
Key = tuple  # (decoder, width, max_tokens, temperature, top_p)


class QueueFull(Exception):
  pass


@dataclasses.dataclass
class Event:
  """What the decode thread tells a request.

  kind: 'delta' (text and the tokens of one chunk, with the step's numbers), 'done' (finish
  reason and usage) or 'error' (status and message).
  """
  kind: str
  text: str = ''
  tokens: tuple[int, ...] = ()
  step: int = 0
  finish_reason: str | None = None
  usage: dict | None = None
  all_tokens: tuple[int, ...] = ()
  status: int = 500
  message: str = ''


@dataclasses.dataclass
class Job:
  """One request inside the batcher."""
  ids: list[int]
  sampling: schemas.Sampling
  emit: Callable[[Event], None]
  prompt: str = ''
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

  @property
  def width(self) -> int:
    return -(-len(self.ids) // PROMPT_WIDTH_MULTIPLE) * PROMPT_WIDTH_MULTIPLE


class _StopText:
  """Stop sequences over streamed text: holds back what could still become one."""

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
  """A job's decoding progress within its batch."""

  def __init__(self, job: Job, tokenizer):
    self.job = job
    self.stream = streaming.TextStream(tokenizer)
    self.stop = _StopText(job.sampling.stop)
    self.count = 0  # Tokens consumed so far.
    self.finished = False
    self.first_token_at = None


class _Batch:
  def __init__(self, key: Key, jobs: list[Job], rows: list[_Row], chunks):
    self.key, self.jobs, self.rows, self.chunks = key, jobs, rows, chunks


class Batcher:
  """Owns the decode thread; `submit` is called from the event loop."""

  def __init__(self, loaded, *, max_batch: int = 8, max_wait_ms: float = 10.0,
               max_queue: int = 256, exact: bool = True, steps_per_chunk: int | None = None,
               metrics=None):
    self.loaded = loaded
    self.tokenizer = loaded.tokenizer
    self.model_cfg = loaded.model.cfg
    self.prepared = state_lib.prepare(loaded.model)
    self.max_batch, self.max_wait = int(max_batch), max_wait_ms / 1000
    self.max_queue, self.exact = int(max_queue), exact
    self.steps_per_chunk = steps_per_chunk
    self.metrics = metrics
    self.fault: Callable[[list[Job]], None] | None = None  # Tests inject failures here.
    self.warm = threading.Event()
    self._intake: queue.Queue[Job] = queue.Queue()
    self._pending: dict[Key, collections.deque[Job]] = collections.defaultdict(
        collections.deque)
    self._active: list[_Batch] = []
    self._requests: dict[Key, request_lib.DecodeRequest] = {}
    self._waiting = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name='mtp-decode', daemon=True)
    self._warmup: list[tuple[str, int]] = []
    self._seeds = itertools.count()

  # ---------------------------------------------------------------- event-loop side

  def start(self, warmup: list[tuple[str, int]] = ()) -> None:
    """Starts the thread; it first compiles (decoder, max_tokens) at the first prompt width."""
    self._warmup = list(warmup)
    self._thread.start()

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)

  @property
  def queue_depth(self) -> int:
    """Requests waiting for a batch."""
    return self._waiting

  @property
  def active_rows(self) -> int:
    return sum(len(b.jobs) for b in list(self._active))

  def check(self, ids: list[int], sampling: schemas.Sampling) -> None:
    """RequestError (400) for a prompt the model cannot take, before it is queued."""
    cfg = self.model_cfg.trunk
    if not ids:
      raise schemas.RequestError('the prompt encodes to no tokens', param='prompt')
    try:
      request_lib.check_prompts(np.asarray([ids]), None, max_new_tokens=sampling.max_tokens,
                                vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
                                eos_id=self.tokenizer.eos_id)
      self._request(self._key(Job(ids, sampling, emit=lambda e: None)))
    except ValueError as e:
      raise schemas.RequestError(str(e).replace('prompt 0 is the longest', 'the prompt'),
                                 param='max_tokens' if 'max_new_tokens' in str(e) else None
                                 ) from None

  def submit(self, job: Job) -> None:
    with self._lock:
      if self._waiting >= self.max_queue:
        raise QueueFull(f'the queue is full ({self.max_queue} requests wait for a batch)')
      self._waiting += 1
    self._intake.put(job)

  # ---------------------------------------------------------------- decode thread

  def _key(self, job: Job) -> Key:
    s = job.sampling
    return (s.decoder, job.width, s.max_tokens, s.temperature, s.top_p)

  def _request(self, key: Key) -> request_lib.DecodeRequest:
    if key not in self._requests:
      decoder, width, max_tokens, temperature, top_p = key
      tok = self.tokenizer
      banned = () if tok.pad_id in (None, tok.eos_id) else (tok.pad_id,)
      self._requests[key] = request_lib.make_request(
          self.model_cfg, width, max_new_tokens=max_tokens, decoder=decoder,
          temperature=temperature, top_p=top_p, row_mapped=self.exact,
          vocab_limit=min(tok.vocab_size, self.model_cfg.trunk.vocab_size), banned_ids=banned)
    return self._requests[key]

  def _loop(self) -> None:
    try:
      self._compile_ahead()
    except Exception:  # noqa: BLE001  Warm-up is an optimization: serve anyway.
      logging.exception('warm-up failed')
    self.warm.set()
    while not self._stop.is_set():
      self._take_arrivals(block=not self._active and not any(self._pending.values()))
      self._start_batches()
      for batch in list(self._active):
        self._advance(batch)

  def _compile_ahead(self) -> None:
    for decoder, max_tokens in self._warmup:
      sampling = schemas.Sampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None,
                                  stop=(), decoder=decoder, stream=False)
      job = Job([self.tokenizer.bos_id], sampling, emit=lambda e: None)
      request = self._request(self._key(job))
      prompts = np.full((self.max_batch, job.width), self.tokenizer.pad_id, np.int32)
      prompts[:, 0] = job.ids[0]
      chunks = driver.decode_chunks(self.prepared, prompts, np.ones(self.max_batch, np.int32),
                                    request, steps_per_chunk=1, eos_id=self.tokenizer.eos_id,
                                    pad_id=self.tokenizer.pad_id)
      for _ in itertools.islice(chunks, 2):
        pass
      chunks.close()

  def _take_arrivals(self, block: bool) -> None:
    """Moves arrived jobs to their key's queue; blocks (briefly) when there is nothing to do."""
    try:
      job = self._intake.get(timeout=0.1) if block else self._intake.get_nowait()
    except queue.Empty:
      return
    while True:
      self._pending[self._key(job)].append(job)
      try:
        job = self._intake.get_nowait()
      except queue.Empty:
        return

  def _start_batches(self) -> None:
    now = time.perf_counter()
    for key, jobs in list(self._pending.items()):
      while jobs and (len(jobs) >= self.max_batch or now - jobs[0].arrived >= self.max_wait
                      or not self._active):
        if not self._active and len(jobs) < self.max_batch and \
            now - jobs[0].arrived < self.max_wait:
          # Nothing runs: wait out max_wait_ms for company, arrivals included.
          time.sleep(max(0.0, self.max_wait - (now - jobs[0].arrived)))
          self._take_arrivals(block=False)
          now = time.perf_counter()
          continue
        taken = [jobs.popleft() for _ in range(min(self.max_batch, len(jobs)))]
        with self._lock:
          self._waiting -= len(taken)
        self._begin(key, [j for j in taken if not j.cancelled.is_set()], taken)

  def _begin(self, key: Key, jobs: list[Job], taken: list[Job]) -> None:
    for job in taken:
      if job.cancelled.is_set():
        self._count(cancelled=1)
    if not jobs:
      return
    try:
      request = self._request(key)
      size = self.max_batch if self.exact else _bucket(len(jobs), self.max_batch)
      width = key[1]
      prompts = np.full((size, width), self.tokenizer.pad_id, np.int32)
      lengths = np.ones(size, np.int32)
      for row, job in enumerate(jobs):
        prompts[row, :len(job.ids)] = job.ids
        lengths[row] = len(job.ids)
      for row in range(len(jobs), size):  # Fillers: a copy of the first row, inactive.
        prompts[row], lengths[row] = prompts[0], lengths[0]
      active = np.arange(size) < len(jobs)
      seed = jobs[0].sampling.seed
      rng = jax.random.fold_in(jax.random.key(seed if seed is not None else
                                              next(self._seeds) + 1), 0)
      streaming_batch = any(j.sampling.stream for j in jobs)
      # Streams show every verification step: one step per chunk.
      steps = 1 if streaming_batch else request_lib.steps_per_chunk(self.steps_per_chunk,
                                                                     key[0])
      rows = [_Row(job, self.tokenizer) for job in jobs]
      chunks = driver.decode_chunks(
          self.prepared, prompts, lengths, request, steps_per_chunk=steps, rng=rng,
          eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, active=active,
          stop=lambda: self._stopped(rows, size))
      self._active.append(_Batch(key, jobs, rows, chunks))
      self._count(batches=1, batch_rows=len(jobs),
                  prompt_tokens=sum(len(j.ids) for j in jobs))
    except Exception as e:  # noqa: BLE001  One batch fails, not the server.
      self._fail(jobs, e)

  def _stopped(self, rows: list[_Row], size: int) -> np.ndarray:
    mask = np.zeros(size, bool)
    for i, row in enumerate(rows):
      if row.finished or row.job.cancelled.is_set():
        if not row.finished:
          row.finished = True
          self._count(cancelled=1)
        mask[i] = True
    return mask

  def _advance(self, batch: _Batch) -> None:
    """One chunk of `batch`: its rows' new tokens go out; finished rows end."""
    try:
      if self.fault is not None:
        self.fault(batch.jobs)
      result = next(batch.chunks, None)
      if result is None:
        self._active.remove(batch)
        for row in batch.rows:
          if not row.finished:  # Should not happen: every row ends before the loop does.
            self._finish(row, None, 'length')
        return
      done = _finished(result, batch.key[2], self.tokenizer.eos_id)
      for i, row in enumerate(batch.rows):
        if row.finished:
          continue
        self._emit_row(row, result, i, bool(done[i]), batch.key[2])
    except Exception as e:  # noqa: BLE001
      if batch in self._active:
        self._active.remove(batch)
      batch.chunks.close()
      self._fail([r.job for r in batch.rows if not r.finished], e)

  def _emit_row(self, row: _Row, result, i: int, done: bool, max_tokens: int) -> None:
    count = int(result.num_generated[i])
    new = [int(t) for t in result.tokens[i, row.count:count]]
    row.count = count
    if new and row.first_token_at is None:
      row.first_token_at = time.perf_counter()
    text = row.stream.push(new) if new else ''
    if done:
      text += row.stream.flush()
    text, stopped = row.stop.push(text, final=done)
    step = int(result.num_steps[i])
    self._count(completion_tokens=len(new))
    if text or new:
      row.job.emit(Event('delta', text=text, tokens=tuple(new), step=step))
    if stopped or done:
      tokens = [int(t) for t in result.tokens[i, :count]]
      eos = bool(tokens) and tokens[-1] == self.tokenizer.eos_id
      self._finish(row, result, 'stop' if (stopped or eos) else 'length', i)

  def _finish(self, row: _Row, result, reason: str, i: int | None = None) -> None:
    row.finished = True
    job = row.job
    tokens, steps, per_step = (), 0, 0.0
    if result is not None:
      count = int(result.num_generated[i])
      tokens = tuple(int(t) for t in result.tokens[i, :count])
      steps = int(result.num_steps[i])
      per_step = float(np.asarray(result.mean_accepted)[i])
    self._count(verification_steps=steps)
    usage = schemas.usage(len(job.ids), len(tokens), steps, per_step)
    if self.metrics is not None:
      self.metrics.observe_latency(
          time.perf_counter() - job.arrived,
          None if row.first_token_at is None else row.first_token_at - job.arrived)
    job.emit(Event('done', finish_reason=reason, usage=usage, all_tokens=tokens))

  def _fail(self, jobs: list[Job], error: Exception) -> None:
    logging.exception('a decode batch failed: %s', error)
    self._count(batch_failures=1)
    for job in jobs:
      job.emit(Event('error', status=500,
                     message=f'the decode batch of this request failed: {error}'))

  def _count(self, **counts) -> None:
    if self.metrics is not None:
      self.metrics.add(**counts)


def _finished(result, max_tokens: int, eos_id: int) -> np.ndarray:
  """[B] rows that ended: max_tokens reached, or EOS last."""
  counts = np.asarray(result.num_generated)
  last = np.asarray(result.tokens)[np.arange(len(counts)), np.maximum(counts - 1, 0)]
  return (counts >= max_tokens) | ((counts > 0) & (last == eos_id))


def _bucket(n: int, limit: int) -> int:
  """The smallest power of two >= n (capped at `limit`): a bounded set of batch shapes."""
  size = 1
  while size < n:
    size *= 2
  return min(size, limit)
