"""The HTTP routes: OpenAI's completions, chat completions and models, plus health and metrics.

Handlers only check, tokenize and wait: reading JSON, rendering chat and tokenizing run on a
worker thread (a 10 MB prompt tokenized on the event loop stalled `/health` for 6 s), decoding
on the batcher's thread, whose events come back through an asyncio queue, so the event loop
never blocks on the model. Bodies are bounded (`limits.BodyLimit`); metrics label requests by
route, never by raw path.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time

import fastapi
from fastapi import responses
from fastapi import staticfiles
from starlette import exceptions as starlette_exceptions

from mtp.serving import batcher as batcher_lib
from mtp.serving import chat as chat_lib
from mtp.serving import limits
from mtp.serving import metrics as metrics_lib
from mtp.serving import schemas

STATIC_DIR = pathlib.Path(__file__).parent / 'static'
_PLACEHOLDER = ('<!doctype html><title>mtp</title><p>mtp server: POST /v1/completions, '
                '/v1/chat/completions; GET /v1/models, /health, /metrics.</p>')
_NON_STREAM_POLL_S = 0.5  # How often a waiting non-streamed request checks its client is there.


def create_app(batcher: batcher_lib.Batcher, *, model_name: str = 'mtp',
               default_max_tokens: int = 16, default_decoder: str | None = None,
               metrics: metrics_lib.Metrics | None = None,
               max_request_bytes: int = limits.MAX_REQUEST_BYTES) -> fastapi.FastAPI:
  """The server's app around a started (or starting) `Batcher`."""
  metrics = metrics or batcher.metrics or metrics_lib.Metrics()
  metrics.gauges.update(queue_depth=lambda: batcher.queue_depth,
                        active_rows=lambda: batcher.active_rows,
                        warm=lambda: int(batcher.warm.is_set()))
  tokenizer = batcher.tokenizer
  decoders = batcher.decoders
  default_decoder = default_decoder or decoders[0]
  app = fastapi.FastAPI(title='mtp', docs_url=None, redoc_url=None)
  created = int(time.time())

  def error(status: int, message: str, kind: str, endpoint: str, param=None, code=None,
            headers=None):
    metrics.request(endpoint, status)
    return responses.JSONResponse(schemas.error_body(message, kind, param, code),
                                  status_code=status, headers=headers)

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(request: fastapi.Request, exc):
    kind = 'not_found_error' if exc.status_code == 404 else 'invalid_request_error'
    return error(exc.status_code, str(exc.detail), kind, _endpoint(request.scope))

  @app.exception_handler(Exception)
  async def server_error(request: fastapi.Request, exc: Exception):
    return error(500, f'internal error: {exc}', 'server_error', _endpoint(request.scope))

  limits.check(max_request_bytes=max_request_bytes)
  routes = {'/v1/completions', '/v1/chat/completions'}
  app.add_middleware(limits.BodyLimit, max_bytes=max_request_bytes, on_reject=lambda scope, s: (
      metrics.request(scope['path'] if scope['path'] in routes else metrics_lib.UNMATCHED, s)))

  @app.get('/health')
  async def health():
    metrics.request('/health', 200)
    return {'status': 'ok', 'warm': batcher.warm.is_set(), 'model': model_name,
            'queue_depth': batcher.queue_depth, 'active_rows': batcher.active_rows,
            'compiled': list(batcher.compiled)}

  @app.get('/metrics')
  async def prometheus():
    metrics.request('/metrics', 200)
    return responses.PlainTextResponse(metrics.render(),
                                       media_type='text/plain; version=0.0.4')

  @app.get('/v1/models')
  async def models():
    metrics.request('/v1/models', 200)
    # `mtp` (non-standard): the decoders a request may name, for the page and scripts.
    return {'object': 'list', 'data': [{'id': model_name, 'object': 'model',
                                        'created': created, 'owned_by': 'mtp',
                                        'mtp': {'decoders': list(decoders),
                                                'default_decoder': default_decoder}}]}

  @app.get('/')
  async def index():
    page = STATIC_DIR / 'index.html'
    if page.is_file():
      return responses.FileResponse(page)
    return responses.HTMLResponse(_PLACEHOLDER)

  app.mount('/static', staticfiles.StaticFiles(directory=STATIC_DIR, check_dir=False),
            name='static')

  def read(raw: bytes, chat: bool):
    """(options, prompt text, ids) of a request body, checked: on a worker thread."""
    body = schemas.parse_json(raw)
    options = schemas.options(body, default_max_tokens=default_max_tokens, decoders=decoders,
                              default_decoder=default_decoder, chat=chat,
                              max_n=batcher.max_batch)
    if chat:
      text = chat_lib.render(tokenizer, schemas.messages(body))
      ids = chat_lib.encode(tokenizer, text)
    else:
      text = schemas.prompt(body)
      ids = tokenizer.encode(text)
    batcher.check(ids, options)
    return options, text, ids

  async def generate(request: fastapi.Request, chat: bool):
    endpoint = request.url.path
    try:
      options, text, ids = await asyncio.to_thread(read, await request.body(), chat)
    except schemas.RequestError as e:
      return error(e.status, e.message, e.kind, endpoint, e.param, e.code)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    seed = batcher_lib.fresh_seed() if options.seed is None else options.seed
    emit = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)  # noqa: E731
    jobs = [batcher_lib.Job(ids, options, prompt=text, emit=emit, index=i, seed=seed)
            for i in range(options.n)]
    try:
      for job in jobs:
        batcher.submit(job)
    except batcher_lib.QueueFull as e:
      for job in jobs:
        job.cancelled.set()
      return error(503, f'{e}; retry later', 'server_overloaded', endpoint,
                   code='queue_full', headers={'Retry-After': '1'})
    rid = schemas.new_id('chatcmpl' if chat else 'cmpl')
    if options.stream:
      metrics.request(endpoint, 200)  # The status line goes out with the first byte.
      return responses.StreamingResponse(_sse(jobs, events, rid, model_name, chat),
                                         media_type='text/event-stream',
                                         headers={'Cache-Control': 'no-cache'})
    return await _collect(request, jobs, events, rid, chat, endpoint, error)

  async def _collect(request, jobs, events, rid, chat, endpoint, error):
    texts = [[] for _ in jobs]
    logprobs = [[] for _ in jobs]
    done = {}
    while len(done) < len(jobs):
      try:
        event = await asyncio.wait_for(events.get(), _NON_STREAM_POLL_S)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          for job in jobs:
            job.cancelled.set()
          return error(499, 'client closed the request', 'cancelled', endpoint)
        continue
      if event.kind == 'delta':
        texts[event.index].append(event.text)
        if event.logprobs is not None:
          logprobs[event.index].append(event.logprobs)
      elif event.kind == 'error':
        for job in jobs:
          job.cancelled.set()
        return error(event.status, event.message, 'server_error', endpoint)
      else:
        done[event.index] = event
    metrics.request(endpoint, 200)
    options = jobs[0].options
    choices = [schemas.choice(i, ''.join(texts[i]), done[i].finish_reason, chat=chat,
                              logprobs=_joined(logprobs[i], chat)
                              if options.logprobs is not None else None)
               for i in range(len(jobs))]
    usages = [done[i].usage for i in range(len(jobs))]
    usage = dict(usages[0], completion_tokens=sum(u['completion_tokens'] for u in usages))
    usage['total_tokens'] = usage['prompt_tokens'] + usage['completion_tokens']
    extra = {'tokens': list(done[0].all_tokens), 'decoder': options.decoder}
    if len(jobs) > 1:
      extra['choices_tokens'] = [list(done[i].all_tokens) for i in range(len(jobs))]
    return schemas.completion_body(rid, model_name, choices, chat=chat, usage_=usage,
                                   extra=extra)

  @app.post('/v1/completions')
  async def completions(request: fastapi.Request):
    return await generate(request, chat=False)

  @app.post('/v1/chat/completions')
  async def chat_completions(request: fastapi.Request):
    return await generate(request, chat=True)

  return app


def _joined(pieces: list[dict], chat: bool) -> dict:
  """One choice's logprobs from its chunks' pieces."""
  if chat:
    return {'content': [entry for piece in pieces for entry in piece['content']]}
  joined = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
  for piece in pieces:
    for key in joined:
      joined[key] += piece[key]
  return joined


async def _sse(jobs: list[batcher_lib.Job], events: asyncio.Queue, rid: str, model: str,
               chat: bool):
  """Server-sent events: one chunk per verification step's tokens of each choice, then its
  finish and usage, then [DONE].

  Each chunk's non-standard `mtp` field holds the step number, how many tokens the step
  accepted and their ids, so a page can shade each step's run. A client that goes away cancels
  this generator: its rows are stopped at the next chunk boundary.
  """
  def data(body) -> str:
    return f'data: {json.dumps(body, ensure_ascii=False)}\n\n'

  def chunk(choices, **kwargs):
    return data(schemas.completion_body(rid, model, choices, chat=chat, chunk=True, **kwargs))

  try:
    if chat:  # OpenAI's first chat chunks name the role.
      yield chunk([schemas.choice(job.index, '', None, chat=True, chunk=True) for job in jobs])
    finished = 0
    while finished < len(jobs):
      event = await events.get()
      if event.kind == 'delta':
        yield chunk([schemas.choice(event.index, event.text, None, chat=chat, chunk=True,
                                    logprobs=event.logprobs, role=False)],
                    extra={'step': event.step, 'accepted': len(event.tokens),
                           'tokens': list(event.tokens), 'index': event.index})
      elif event.kind == 'error':
        yield data(schemas.error_body(event.message, 'server_error'))
        break
      else:
        finished += 1
        final = schemas.choice(event.index, '', event.finish_reason, chat=chat, chunk=True,
                               role=False)
        if chat:
          final['delta'] = {}
        yield chunk([final], usage_=event.usage,
                    extra={'tokens': list(event.all_tokens), 'index': event.index})
    yield 'data: [DONE]\n\n'
  finally:
    for job in jobs:
      job.cancelled.set()  # A no-op once a job has finished; frees its row otherwise.


def _endpoint(scope) -> str:
  """The metrics label of a request: its route's template, or UNMATCHED (bounded: raw paths
  would let any client add series)."""
  route = scope.get('route')
  return getattr(route, 'path', None) or metrics_lib.UNMATCHED
