"""The HTTP routes: OpenAI's completions, chat completions and models, plus health and metrics.

Handlers only check, tokenize and wait: decoding happens on the batcher's thread, whose events
come back through an asyncio queue, so the event loop never blocks on the model.
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

from mtp.decode import decoders as decoders_lib
from mtp.serving import batcher as batcher_lib
from mtp.serving import chat as chat_lib
from mtp.serving import metrics as metrics_lib
from mtp.serving import schemas

STATIC_DIR = pathlib.Path(__file__).parent / 'static'
_PLACEHOLDER = ('<!doctype html><title>mtp</title><p>mtp server: POST /v1/completions, '
                '/v1/chat/completions; GET /v1/models, /health, /metrics.</p>')
_NON_STREAM_POLL_S = 0.5  # How often a waiting non-streamed request checks its client is there.


def create_app(batcher: batcher_lib.Batcher, *, model_name: str = 'mtp',
               default_max_tokens: int = 16, default_decoder: str = decoders_lib.SERVED_DEFAULT,
               metrics: metrics_lib.Metrics | None = None) -> fastapi.FastAPI:
  """The server's app around a started (or starting) `Batcher`."""
  metrics = metrics or batcher.metrics or metrics_lib.Metrics()
  metrics.gauges.update(queue_depth=lambda: batcher.queue_depth,
                        active_rows=lambda: batcher.active_rows,
                        warm=lambda: int(batcher.warm.is_set()))
  tokenizer = batcher.tokenizer
  decoders = tuple(d for d in decoders_lib.SERVED
                   if batcher.model_cfg.mtp_num_heads or not decoders_lib.get(d).drafts)
  if default_decoder not in decoders:
    default_decoder = 'autoregressive'
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
    return error(exc.status_code, str(exc.detail), kind, request.url.path)

  @app.exception_handler(Exception)
  async def server_error(request: fastapi.Request, exc: Exception):
    return error(500, f'internal error: {exc}', 'server_error', request.url.path)

  @app.get('/health')
  async def health():
    metrics.request('/health', 200)
    return {'status': 'ok', 'warm': batcher.warm.is_set(), 'model': model_name,
            'queue_depth': batcher.queue_depth, 'active_rows': batcher.active_rows}

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

  async def generate(request: fastapi.Request, chat: bool):
    endpoint = request.url.path
    try:
      body = schemas.parse_json(await request.body())
      sampling = schemas.sampling(body, default_max_tokens=default_max_tokens,
                                  decoders=decoders, default_decoder=default_decoder)
      if chat:
        text = chat_lib.render(tokenizer, schemas.messages(body))
        ids = chat_lib.encode(tokenizer, text)
      else:
        text = schemas.prompt(body)
        ids = tokenizer.encode(text)
      batcher.check(ids, sampling)
    except schemas.RequestError as e:
      return error(e.status, e.message, e.kind, endpoint, e.param, e.code)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = batcher_lib.Job(ids, sampling, prompt=text,
                          emit=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
    try:
      batcher.submit(job)
    except batcher_lib.QueueFull as e:
      return error(503, f'{e}; retry later', 'server_overloaded', endpoint,
                   code='queue_full', headers={'Retry-After': '1'})
    rid = schemas.new_id('chatcmpl' if chat else 'cmpl')
    if sampling.stream:
      metrics.request(endpoint, 200)  # The status line goes out with the first byte.
      return responses.StreamingResponse(_sse(job, events, rid, model_name, chat),
                                         media_type='text/event-stream',
                                         headers={'Cache-Control': 'no-cache'})
    return await _collect(request, job, events, rid, chat, endpoint, error)

  async def _collect(request, job, events, rid, chat, endpoint, error):
    text = []
    while True:
      try:
        event = await asyncio.wait_for(events.get(), _NON_STREAM_POLL_S)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          job.cancelled.set()
          return error(499, 'client closed the request', 'cancelled', endpoint)
        continue
      if event.kind == 'delta':
        text.append(event.text)
      elif event.kind == 'error':
        return error(event.status, event.message, 'server_error', endpoint)
      else:
        metrics.request(endpoint, 200)
        return schemas.completion_body(
            rid, model_name, ''.join(text), event.finish_reason, chat=chat, usage_=event.usage,
            extra={'tokens': list(event.all_tokens), 'decoder': job.sampling.decoder})

  @app.post('/v1/completions')
  async def completions(request: fastapi.Request):
    return await generate(request, chat=False)

  @app.post('/v1/chat/completions')
  async def chat_completions(request: fastapi.Request):
    return await generate(request, chat=True)

  return app


async def _sse(job: batcher_lib.Job, events: asyncio.Queue, rid: str, model: str, chat: bool):
  """Server-sent events: one chunk per verification step's tokens, then usage, then [DONE].

  Each chunk's non-standard `mtp` field holds the step number, how many tokens the step
  accepted and their ids, so a page can shade each step's run. A client that goes away cancels
  this generator: its row is stopped at the next chunk boundary.
  """
  def data(body) -> str:
    return f'data: {json.dumps(body, ensure_ascii=False)}\n\n'

  try:
    if chat:  # OpenAI's first chat chunk names the role.
      yield data(schemas.completion_body(rid, model, '', None, chat=True, chunk=True))
    while True:
      event = await events.get()
      if event.kind == 'delta':
        yield data(schemas.completion_body(
            rid, model, event.text, None, chat=chat, chunk=True,
            extra={'step': event.step, 'accepted': len(event.tokens),
                   'tokens': list(event.tokens)}))
      elif event.kind == 'error':
        yield data(schemas.error_body(event.message, 'server_error'))
        break
      else:
        final = schemas.completion_body(rid, model, '', event.finish_reason, chat=chat,
                                        chunk=True, usage_=event.usage,
                                        extra={'tokens': list(event.all_tokens)})
        if chat:
          final['choices'][0]['delta'] = {}
        yield data(final)
        break
    yield 'data: [DONE]\n\n'
  finally:
    job.cancelled.set()  # A no-op once the job has finished; frees the row otherwise.
