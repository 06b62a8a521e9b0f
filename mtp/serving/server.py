"""Running the app: a `Batcher` and uvicorn around a loaded model, in this thread or another."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from mtp.serving import app as app_lib
from mtp.serving import batcher as batcher_lib
from mtp.serving import limits
from mtp.serving import metrics as metrics_lib
from mtp.serving import schemas


def build(loaded, *, decoders=None, max_batch: int = 8, max_wait_ms: float = 10.0,
          max_queue: int = 256, exact: bool = True, steps_per_chunk: int | None = None,
          model_name: str = 'mtp', default_max_tokens: int = 16, tree=None,
          tree_budget: int | None = None, max_logprobs: int = schemas.MAX_LOGPROBS,
          max_request_bytes: int = limits.MAX_REQUEST_BYTES):
  """(app, batcher) with the batcher's thread started (its lanes compile there, in the
  background; /health says when they are warm).

  decoders: the decoders served, the first the default (None: `served_decoders`);
  max_request_bytes: the largest request body (413 past it); the other options are the
  `Batcher`'s."""
  from mtp.decode import engine  # pylint: disable=import-outside-toplevel  # JAX.
  metrics = metrics_lib.Metrics()
  metrics.external['compilations'] = ('Decoder programs compiled since start (flat after '
                                      'warm-up).', engine.compilations)
  decoders = tuple(decoders or served_decoders(loaded))
  batcher = batcher_lib.Batcher(loaded, decoders=decoders, max_batch=max_batch,
                                max_wait_ms=max_wait_ms, max_queue=max_queue, exact=exact,
                                steps_per_chunk=steps_per_chunk, metrics=metrics, tree=tree,
                                tree_budget=tree_budget, max_logprobs=max_logprobs)
  app = app_lib.create_app(batcher, model_name=model_name,
                           default_max_tokens=default_max_tokens, metrics=metrics,
                           max_request_bytes=max_request_bytes)
  batcher.start()
  return app, batcher


def served_decoders(loaded) -> tuple[str, ...]:
  """Every registered decoder, the default first (a model without heads drafts by lookup)."""
  from mtp.decode import decoders  # pylint: disable=import-outside-toplevel
  return (decoders.DEFAULT,) + tuple(n for n in decoders.NAMES if n != decoders.DEFAULT)


def free_socket(host: str = '127.0.0.1', port: int = 0) -> socket.socket:
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  return sock


@contextlib.contextmanager
def running(loaded, host: str = '127.0.0.1', request_timeout_s: float = limits.REQUEST_TIMEOUT_S,
            max_connections: int = limits.MAX_CONNECTIONS, **options):
  """Serves on a free localhost port from a thread; yields (base_url, batcher).

  request_timeout_s, max_connections: `limits.uvicorn_config`'s; the other options `build`'s.
  """
  limits.check(request_timeout_s=request_timeout_s, max_connections=max_connections)
  app, batcher = build(loaded, **options)
  sock = free_socket(host)
  config = limits.uvicorn_config(app, request_timeout_s=request_timeout_s,
                                 max_connections=max_connections, log_level='warning',
                                 timeout_graceful_shutdown=2)
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not server.started:
    if time.monotonic() > deadline or not thread.is_alive():
      raise RuntimeError('the server did not start')
    time.sleep(0.02)
  port = sock.getsockname()[1]
  try:
    yield f'http://{host}:{port}', batcher
  finally:
    server.should_exit = True
    thread.join(timeout=10)
    batcher.close()
    sock.close()
