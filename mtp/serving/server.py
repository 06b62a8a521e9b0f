"""Running the app: a `Batcher` and uvicorn around a loaded model, in this thread or another."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from mtp.serving import app as app_lib
from mtp.serving import batcher as batcher_lib
from mtp.serving import metrics as metrics_lib


def build(loaded, *, max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256,
          exact: bool = True, steps_per_chunk: int | None = None, model_name: str = 'mtp',
          default_max_tokens: int = 16, decoder: str | None = None,
          warmup: list[tuple[str, int]] = (), tree=None, tree_budget: int = 0):
  """(app, batcher) with the batcher's thread started (warm-up runs there, in the background).

  `tree`, `tree_budget`: the speculative decoder's block (`Batcher`)."""
  metrics = metrics_lib.Metrics()
  batcher = batcher_lib.Batcher(loaded, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                max_queue=max_queue, exact=exact,
                                steps_per_chunk=steps_per_chunk, metrics=metrics, tree=tree,
                                tree_budget=tree_budget)
  kwargs = {} if decoder is None else {'default_decoder': decoder}
  app = app_lib.create_app(batcher, model_name=model_name,
                           default_max_tokens=default_max_tokens, metrics=metrics, **kwargs)
  batcher.start(warmup)
  return app, batcher


def free_socket(host: str = '127.0.0.1', port: int = 0) -> socket.socket:
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  return sock


@contextlib.contextmanager
def running(loaded, host: str = '127.0.0.1', **options):
  """Serves on a free localhost port from a thread; yields (base_url, batcher)."""
  app, batcher = build(loaded, **options)
  sock = free_socket(host)
  config = uvicorn.Config(app, log_level='warning', timeout_graceful_shutdown=2)
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
