"""What a request may cost the server before it is served: its size and the time it takes to
arrive.

* `BodyLimit`, ASGI middleware: a body over `max_bytes` gets a 413 at once, without reading the
  rest when its Content-Length says so (one 100 MB body held the event loop for minutes).
* `deadline_protocol`: uvicorn's h11 protocol with a deadline for receiving a whole request,
  headers and body. uvicorn has none (its keep-alive timeout only covers idle time between
  requests, and middleware runs only once the headers are in), so a client sending a byte now
  and then held its connection forever. The deadline is disarmed once the request is in:
  long streamed answers are not cut.
* `uvicorn_config`: both, and a cap on concurrent connections (`limit_concurrency`: 503 past it).
"""

from __future__ import annotations

import json
import logging
from typing import Callable

import uvicorn
from uvicorn.protocols.http import h11_impl

MAX_REQUEST_BYTES = 1 << 20  # A 2048-token prompt is ~10 KB of JSON; chat histories more.
REQUEST_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 512

_BODY_METHODS = (b'POST', b'PUT', b'PATCH')


def _error_json(message: str, code: str) -> bytes:
  return json.dumps({'error': {'message': message, 'type': 'invalid_request_error',
                               'param': None, 'code': code}}).encode()


class BodyLimit:
  """ASGI middleware: request bodies of at most `max_bytes`, read whole before the app runs.

  on_reject(scope, status) is called for each refused request (the server's metrics).
  """

  def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES,
               on_reject: Callable[[dict, int], None] | None = None):
    self.app, self.max_bytes, self.on_reject = app, int(max_bytes), on_reject

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    declared = dict(scope['headers']).get(b'content-length')
    if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
      return await self._too_large(scope, send, int(declared))
    if scope['method'].encode() not in _BODY_METHODS:
      return await self.app(scope, receive, send)
    chunks, size = [], 0
    while True:
      message = await receive()
      if message['type'] == 'http.disconnect':
        return None  # The client left (or its request timed out): nobody to answer.
      chunk = message.get('body', b'')
      size += len(chunk)
      if size > self.max_bytes:
        return await self._too_large(scope, send, None)
      chunks.append(chunk)
      if not message.get('more_body', False):
        break
    body, given = b''.join(chunks), False

    async def replay():
      nonlocal given
      if not given:
        given = True
        return {'type': 'http.request', 'body': body, 'more_body': False}
      return await receive()  # After the body: a disconnect, when the client leaves.
    return await self.app(scope, replay, send)

  async def _too_large(self, scope, send, declared: int | None):
    if self.on_reject is not None:
      self.on_reject(scope, 413)
    size = f'is {declared} bytes' if declared is not None else 'goes on past the limit'
    body = _error_json(f'the request body {size}: this server takes at most '
                       f'{self.max_bytes} (--max_request_bytes)', 'request_too_large')
    # `connection: close`: the rest of the body is not read.
    await send({'type': 'http.response.start', 'status': 413,
                'headers': [(b'content-type', b'application/json'),
                            (b'content-length', str(len(body)).encode()),
                            (b'connection', b'close')]})
    await send({'type': 'http.response.body', 'body': body})


_TIMED_OUT = (b'HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n'
              b'connection: close\r\ncontent-length: %d\r\n\r\n%s')


def deadline_protocol(seconds: float) -> type:
  """uvicorn's H11Protocol, closing a connection whose request (headers and body) has not all
  arrived `seconds` after it began (with a 408 when no answer has started)."""

  class DeadlineH11Protocol(h11_impl.H11Protocol):
    _deadline = None

    def connection_made(self, transport):
      super().connection_made(transport)
      self._arm()

    def data_received(self, data: bytes) -> None:
      if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
        self._arm()  # The next request on a kept-alive connection begins.
      super().data_received(data)
      if self.cycle is not None and not self.cycle.more_body:
        self._disarm()  # The request is in: its answer may take as long as it takes.

    def connection_lost(self, exc):
      self._disarm()
      super().connection_lost(exc)

    def _arm(self):
      self._disarm()
      self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self):
      if self._deadline is not None:
        self._deadline.cancel()
        self._deadline = None

    def _expired(self):
      self._deadline = None
      if self.transport.is_closing():
        return
      logging.getLogger('uvicorn.error').warning(
          'dropped a client whose request took over %gs to arrive (--request_timeout_s)',
          seconds)
      if self.cycle is None or not self.cycle.response_started:
        body = _error_json(f'the request did not arrive within {seconds:g}s', 'timeout')
        self.transport.write(_TIMED_OUT % (len(body), body))
      self.transport.close()

  return DeadlineH11Protocol


def check(*, request_timeout_s: float = REQUEST_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
          max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
  """ValueError naming the first bad limit."""
  if not request_timeout_s > 0:
    raise ValueError(f'--request_timeout_s must be > 0, got {request_timeout_s}')
  if max_connections < 1:
    raise ValueError(f'--max_connections must be >= 1, got {max_connections}')
  if max_request_bytes < 1:
    raise ValueError(f'--max_request_bytes must be >= 1, got {max_request_bytes}')


def uvicorn_config(app, *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                   max_connections: int = MAX_CONNECTIONS, **options) -> uvicorn.Config:
  """A uvicorn config for `app` with the request deadline and the connection cap."""
  check(request_timeout_s=request_timeout_s, max_connections=max_connections)
  return uvicorn.Config(app, http=deadline_protocol(request_timeout_s),
                        limit_concurrency=int(max_connections), **options)
