"""Scheduling requests onto the batched decode loop, on one worker thread: continuous batching.

Requests that share a compiled decoder (decoder, prompt width bucket, max_tokens, sampling
settings: a `Key`) share a running batch of `max_batch` slots (`driver.Slots`). Between chunks
of loop steps, finished, stopped and cancelled rows leave and pending requests of the key join
the free slots at once (their prefill is spliced into the running state). A key with no running
batch starts one when `max_batch` requests wait or the first has waited `max_wait_ms`. Batches
of different keys take turns, one chunk each, so no request waits for another batch to end.

Exactness: in `exact` mode (the default) batches are row-mapped (`decode/row_mapped.py`):
every row computes what a batch of one computes, bit for bit, so a greedy request returns
`launch.generate`'s tokens whatever shares its batch and whenever it joined. The batch keeps
`launch.generate`'s prompt width (`mtp.generate` pads to a multiple of 32) and max_tokens,
hence its KV-cache size: XLA:CPU's attention reductions depend on that size too. Empty slots
cost nothing there (skipped under `lax.cond`), so each key compiles one batch shape. Without
`exact`, rows share matmuls (faster for big models; equal up to float ties).

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

import numpy as np

from mtp.decode import decoders
from mtp.decode import driver
from mtp.decode import request as request_lib
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
  """A running slot batch of one key: rows join free slots and leave between chunks."""

  def __init__(self, key: Key, slots, size: int):
    self.key, self.slots = key, slots
    self.rows: list[_Row | None] = [None] * size

  @property
  def live(self) -> list[_Row]:
    return [r for r in self.rows if r is not None]

  @property
  def jobs(self) -> list[Job]:
    return [r.job for r in self.live]

  def free(self) -> list[int]:
    # A finished row's slot is free at once: joining overwrites the whole row.
    return [i for i, r in enumerate(self.rows) if r is None or r.finished]


class Batcher:
  """Owns the decode thread; `submit` is called from the event loop."""

  def __init__(self, loaded, *, max_batch: int = 8, max_wait_ms: float = 10.0,
               max_queue: int = 256, exact: bool = True, steps_per_chunk: int | None = None,
               metrics=None, tree=None, tree_budget: int = 0):
    """`tree` and `tree_budget`: the drafting decoders' block, as `api.resolve_tree` returns
    it (a static tree or None for a chain, or a dynamic tree's superset and budget)."""
    self.loaded = loaded
    self.tree, self.tree_budget = tree, int(tree_budget or 0)
    if tree is not None or self.tree_budget:  # A bad block fails here, not in every request.
      request_lib.make_request(loaded.model.cfg, PROMPT_WIDTH_MULTIPLE, max_new_tokens=1,
                               decoder='speculative', tree=tree, tree_budget=self.tree_budget)
    self.tokenizer = loaded.tokenizer
    self.model_cfg = loaded.model.cfg
    self.prepared = loaded.prepared()
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
      drafts = decoders.get(decoder).drafts
      self._requests[key] = request_lib.make_request(
          self.model_cfg, width, max_new_tokens=max_tokens, decoder=decoder,
          tree=self.tree if drafts else None, tree_budget=self.tree_budget if drafts else 0,
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
      self._admit()
      for batch in list(self._active):
        self._advance(batch)

  def _compile_ahead(self) -> None:
    """Compiles a key's prefill, splice and loop: a batch of one short prompt, two chunks."""
    for decoder, max_tokens in self._warmup:
      sampling = schemas.Sampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None,
                                  stop=(), decoder=decoder, stream=False)
      job = Job([self.tokenizer.bos_id], sampling, emit=lambda e: None)
      slots = self._slots(self._key(job))
      prompts, lengths, rows = self._layout([job], [0], job.width)
      slots.join(prompts, lengths, rows)
      slots.run(1)
      slots.join(prompts, lengths, rows)
      slots.run(1)
      slots.result()

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

  def _admit(self) -> None:
    """Pending jobs join a running batch of their key at once; else, after waiting at most
    max_wait_ms for company, they start a new one."""
    for key, jobs in list(self._pending.items()):
      for batch in [b for b in self._active if b.key == key]:
        if jobs and batch.free():
          self._join(batch, self._take(jobs, len(batch.free())))
      if not jobs:
        continue
      waited = time.perf_counter() - jobs[0].arrived
      if len(jobs) < self.max_batch and waited < self.max_wait:
        if self._active:
          continue  # Others decode meanwhile; look again after their next chunk.
        time.sleep(self.max_wait - waited)  # Nothing runs: wait out max_wait_ms for company.
        self._take_arrivals(block=False)
      while jobs:
        try:
          batch = _Batch(key, self._slots(key), self._size(key))
        except Exception as e:  # noqa: BLE001
          self._fail(self._take(jobs, len(jobs)), e)
          break
        self._active.append(batch)
        self._join(batch, self._take(jobs, self.max_batch))

  def _take(self, jobs: collections.deque, n: int) -> list[Job]:
    taken = [jobs.popleft() for _ in range(min(n, len(jobs)))]
    with self._lock:
      self._waiting -= len(taken)
    live = [j for j in taken if not j.cancelled.is_set()]
    self._count(cancelled=len(taken) - len(live))
    return live

  def _size(self, key: Key) -> int:
    return self.max_batch

  def _slots(self, key: Key):
    seed = next(self._seeds) + 1
    return driver.Slots(self.prepared, self._request(key), self._size(key), rng=seed,
                        eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)

  def _layout(self, jobs: list[Job], slots: list[int], width: int):
    """Prompts [B, width], lengths and the rows joined; other rows copy a joined one."""
    size = self.max_batch
    prompts = np.full((size, width), self.tokenizer.pad_id, np.int32)
    lengths = np.full(size, len(jobs[0].ids), np.int32)
    prompts[:, :len(jobs[0].ids)] = jobs[0].ids
    rows = np.zeros(size, bool)
    for slot, job in zip(slots, jobs):
      prompts[slot] = self.tokenizer.pad_id
      prompts[slot, :len(job.ids)] = job.ids
      lengths[slot], rows[slot] = len(job.ids), True
    return prompts, lengths, rows

  def _join(self, batch: _Batch, jobs: list[Job]) -> None:
    """Prefills jobs into free slots of `batch`; their first tokens go out at once."""
    if not jobs:
      return
    slots = batch.free()[:len(jobs)]
    try:
      if self.fault is not None:
        self.fault(jobs)
      prompts, lengths, rows = self._layout(jobs, slots, batch.key[1])
      batch.slots.join(prompts, lengths, rows)
      for slot, job in zip(slots, jobs):
        batch.rows[slot] = _Row(job, self.tokenizer)
      self._count(batches=1, batch_rows=len(jobs), prompt_tokens=sum(len(j.ids) for j in jobs))
      self._emit(batch, batch.slots.result())
    except Exception as e:  # noqa: BLE001  These requests fail, not the server.
      for slot, job in zip(slots, jobs):
        if batch.rows[slot] is not None and batch.rows[slot].job is job:
          batch.rows[slot] = None
      self._fail([j for j in jobs], e)
      self._drop_if_idle(batch)

  def _stopped(self, batch: _Batch) -> np.ndarray:
    """[B] rows to stop: free slots, finished rows, rows whose client left (freed now)."""
    mask = np.zeros(len(batch.rows), bool)
    for i, row in enumerate(batch.rows):
      if row is not None and row.job.cancelled.is_set() and not row.finished:
        row.finished = True
        self._count(cancelled=1)
      if row is None or row.finished:
        batch.rows[i] = None
        mask[i] = True
    return mask

  def _advance(self, batch: _Batch) -> None:
    """One chunk of `batch`: its rows' new tokens go out; finished rows leave."""
    try:
      batch.slots.stop(self._stopped(batch))
      if not batch.live:
        self._drop_if_idle(batch)
        return
      if self.fault is not None:
        self.fault(batch.jobs)
      # Streams show every verification step: one step per chunk while a row streams.
      steps = 1 if any(j.sampling.stream for j in batch.jobs) else \
          request_lib.steps_per_chunk(self.steps_per_chunk, batch.key[0])
      batch.slots.run(steps)
      self._emit(batch, batch.slots.result())
    except Exception as e:  # noqa: BLE001  One batch fails, not the server.
      self._active.remove(batch)
      self._fail([r.job for r in batch.live if not r.finished], e)

  def _drop_if_idle(self, batch: _Batch) -> None:
    if not batch.live and batch in self._active:
      self._active.remove(batch)  # Its state goes; a later request starts a fresh batch.

  def _emit(self, batch: _Batch, result) -> None:
    done = _finished(result, batch.key[2], self.tokenizer.eos_id)
    for i, row in enumerate(batch.rows):
      if row is not None and not row.finished:
        self._emit_row(row, result, i, bool(done[i]), batch.key[2])

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
