r"""An OpenAI-compatible HTTP server with exact self-speculative decoding.

  python -m launch.serve --workdir=workdirs/code_small [--port=8000] [--max_batch=8] \
      [--max_wait_ms=10] [--decoder=auto|speculative|autoregressive] [--decoders=...] \
      [--model_name=mtp] [--tree=chain|default|auto|dynamic] [--tree_budget=N]

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET / (a page). A greedy request returns exactly what
`launch.generate` gives on the same workdir, whatever else shares its batch. Requests carry
their own temperature, top_p, top_k, max_tokens, seed, stop, n and logprobs; every mix shares
one batch, and nothing compiles after start-up (`mtp_compilations_total` stays flat).
"""

from __future__ import annotations

from absl import app
from absl import flags

from launch import cli
from mtp.decode import decoders

FLAGS = flags.FLAGS
PROGRAM = 'launch.serve'
flags.DEFINE_string('workdir', None, 'Trained workdir (or export directory) to serve.')
flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'], 'Weights and activations in '
                  'this precision (default: the workdir\'s). On CPU, bfloat16 verifies 8 '
                  'tokens for about 1.2x one token\'s cost (float32: 2x); decoding stays exact '
                  'against autoregressive decoding in that precision.')
flags.DEFINE_string('host', '127.0.0.1', 'Address to listen on (0.0.0.0: every interface).')
flags.DEFINE_integer('port', 8000, 'Port to listen on.')
flags.DEFINE_integer('max_batch', 8, 'Rows decoded together at most.')
flags.DEFINE_float('max_wait_ms', 10.0, 'How long a request waits for others to batch with.')
flags.DEFINE_integer('max_queue', 256, 'Requests waiting for a batch at most; more get 503.')
flags.DEFINE_string('model_name', 'mtp', 'The model id that /v1/models lists.')
flags.DEFINE_enum('decoder', decoders.DEFAULT, list(decoders.NAMES),
                  'Decoder of requests that name none (a request may set "decoder").')
flags.DEFINE_list('decoders', None, 'Decoders requests may name (each compiled at start); '
                  'default: all of ' + ', '.join(decoders.NAMES) + '.')
flags.DEFINE_string('tree', None, 'The speculative decoder\'s candidates: chain (the default), '
                    'default (a static 24-node tree), auto (from the heads\' measured accuracies '
                    'and this machine\'s verification cost), dynamic (EAGLE-2: each step and '
                    'row verifies the --tree_budget most probable nodes), or JSON choices.')
flags.DEFINE_integer('tree_budget', None, 'Nodes per step of a dynamic tree, root included '
                     '(--tree is then its superset; with --tree=dynamic, default: sized from '
                     'the measured cost curve).')
flags.DEFINE_integer('default_max_tokens', 16, 'max_tokens of requests that give none.')
flags.DEFINE_bool('exact', True, 'Every greedy request gets exactly its batch-of-one tokens '
                  '(launch.generate\'s): rows share the batch where that holds (bfloat16 on '
                  'CPU), else each runs as a batch of one. --noexact always shares the batch: '
                  'faster in float32 and on GPUs, exact there only up to float ties.')
flags.DEFINE_integer('steps_per_chunk', None, 'Loop steps between host round trips for '
                     'non-streamed batches (default 16, 4 while a row is free so that arrivals '
                     'join sooner; streamed ones take one step per chunk).')
flags.DEFINE_integer('max_logprobs', 20, 'Alternatives per token a request may ask for '
                     '(logprobs, top_logprobs); -1 turns log-probabilities off.')
flags.DEFINE_integer('max_request_bytes', 1 << 20, 'The largest request body; a larger one gets '
                     '413 before the rest is read.')
flags.DEFINE_float('request_timeout_s', 30.0, 'Seconds a request (headers and body) may take to '
                   'arrive; slower clients are dropped (408). Answers may take longer.')
flags.DEFINE_integer('max_connections', 512, 'Concurrent connections at most; past it requests '
                     'get 503.')
flags.mark_flag_as_required('workdir')


def main(argv):
  cli.begin(argv)
  with cli.UserErrors(PROGRAM):
    if FLAGS.max_batch < 1 or FLAGS.max_queue < 1 or FLAGS.max_wait_ms < 0:
      raise ValueError('--max_batch and --max_queue must be >= 1, --max_wait_ms >= 0')
    from mtp.serving import limits  # pylint: disable=import-outside-toplevel
    limits.check(request_timeout_s=FLAGS.request_timeout_s, max_connections=FLAGS.max_connections,
                 max_request_bytes=FLAGS.max_request_bytes)
    served = [FLAGS.decoder] + [d for d in (FLAGS.decoders or decoders.NAMES)
                                if d != FLAGS.decoder]
    for name in served:
      decoders.get(name)  # Names the bad one.
    from mtp.decode import trees  # pylint: disable=import-outside-toplevel
    tree = trees.parse(FLAGS.tree)
    import uvicorn  # After flag parsing: importing JAX is slow.
    import mtp
    from mtp.serving import server
    loaded = mtp.load(FLAGS.workdir, dtype=FLAGS.dtype)
    if not isinstance(loaded, mtp.LoadedModel):
      raise ValueError(f'{FLAGS.workdir} is a jax_export artifact: it runs a whole decode per '
                       'call and cannot join continuous batches; serve the training workdir '
                       'or a params export')
    application, batcher = server.build(
        loaded, decoders=served, max_batch=FLAGS.max_batch, max_wait_ms=FLAGS.max_wait_ms,
        max_queue=FLAGS.max_queue, exact=FLAGS.exact, steps_per_chunk=FLAGS.steps_per_chunk,
        model_name=FLAGS.model_name, default_max_tokens=FLAGS.default_max_tokens, tree=tree,
        tree_budget=FLAGS.tree_budget, max_logprobs=FLAGS.max_logprobs,
        max_request_bytes=FLAGS.max_request_bytes)
    sock = server.free_socket(FLAGS.host, FLAGS.port)
  # The bound port, which --port=0 leaves to the system: scripts read this line.
  print(f'{PROGRAM}: serving {FLAGS.workdir} as {FLAGS.model_name!r} on '
        f'http://{FLAGS.host}:{sock.getsockname()[1]}', flush=True)
  try:
    uvicorn.Server(limits.uvicorn_config(
        application, request_timeout_s=FLAGS.request_timeout_s,
        max_connections=FLAGS.max_connections, log_level='warning')).run(sockets=[sock])
  finally:
    batcher.close()


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
