r"""Decoding with fused projections against the unfused model, side by side in one run.

  python -m benchmarks.fused_projections [--model=smollm2|demo] [--batch_sizes=1,8]

`state.PreparedModel` fuses each attention's q, k and v projections into one matmul and each
MLP's gate and up into another (`transformer.fused_projections`) where it decides to (on CPU).
This times greedy decoding loops (autoregressive, and speculative with a chain of the heads)
both ways, in turns, the fastest of `--repeats` runs counting, and checks that both give the
same tokens. SmolLM2's shape with random weights (float32), or the demo workdir's model.

Writes results/fused_projections.json.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

import benchmarks

FLAGS = flags.FLAGS
flags.DEFINE_enum('model', 'smollm2', ['smollm2', 'demo'], 'The model to decode with.')
flags.DEFINE_string('workdir', 'workdirs/code_small', 'The demo workdir (--model=demo).')
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Batch sizes.')
flags.DEFINE_integer('prompt_tokens', 256, 'Prompt length (random ids).')
flags.DEFINE_integer('max_new_tokens', 64, 'Tokens generated per row.')
flags.DEFINE_integer('repeats', 5, 'Timed runs of each (the fastest counts).')
flags.DEFINE_string('output', 'results/fused_projections.json', 'JSON results.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  import jax
  import numpy as np
  from mtp.decode import plan as plan_lib
  from mtp.decode import settings as settings_lib
  from mtp.decode import state as state_lib

  if FLAGS.model == 'smollm2':
    model = benchmarks.random_model(tiny=False, dtype='float32')
  else:
    import mtp
    model = mtp.load(FLAGS.workdir).model
  prepared = {fuse: state_lib.prepare(model, fuse=fuse) for fuse in (False, True)}
  rows = []
  for b in (int(x) for x in FLAGS.batch_sizes):
    prompts = np.random.default_rng(b).integers(
        0, model.cfg.trunk.vocab_size, (b, FLAGS.prompt_tokens)).astype(np.int32)
    lengths = np.full(b, FLAGS.prompt_tokens, np.int32)
    for decoder in ('autoregressive', 'speculative'):
      engines = {fuse: plan_lib.resolve(p, decoder, max_new_tokens=FLAGS.max_new_tokens,
                                        prompt_width=FLAGS.prompt_tokens, batch_size=b,
                                        greedy_only=True)
                 for fuse, p in prepared.items()}
      settings = engines[False].settings(
          [settings_lib.Sampling(max_tokens=FLAGS.max_new_tokens)] * b)

      def decode(engine):
        return engine.step(engine.prefill(prompts, lengths, settings), FLAGS.max_new_tokens)
      tokens = {fuse: e.result(decode(e)).tokens for fuse, e in engines.items()}  # Compiles.
      best = {False: float('inf'), True: float('inf')}
      for _ in range(FLAGS.repeats):
        for fuse, engine in engines.items():
          start = time.perf_counter()
          state = jax.block_until_ready(decode(engine))
          best[fuse] = min(best[fuse], (time.perf_counter() - start)
                           / int(np.max(jax.device_get(state.num_steps))))
      row = dict(batch_size=b, decoder=decoder, unfused_ms_per_step=best[False] * 1e3,
                 fused_ms_per_step=best[True] * 1e3, ratio=best[True] / best[False],
                 same_tokens=bool(np.array_equal(tokens[False], tokens[True])))
      rows.append(row)
      print(f'{FLAGS.model} batch {b} {decoder:<14}: unfused {row["unfused_ms_per_step"]:.2f} '
            f'ms/step, fused {row["fused_ms_per_step"]:.2f} ({row["ratio"]:.3f}x), same '
            f'tokens: {row["same_tokens"]}', flush=True)
  benchmarks.write_json(FLAGS.output, dict(model=FLAGS.model, prompt_tokens=FLAGS.prompt_tokens,
                                           max_new_tokens=FLAGS.max_new_tokens,
                                           repeats=FLAGS.repeats, rows=rows,
                                           device=jax.devices()[0].device_kind))


if __name__ == '__main__':
  app.run(main)
