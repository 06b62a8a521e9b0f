r"""Training cost of multi-token heads, measured side by side in one run.

  python -m benchmarks.train_cost [--config=configs/code_small.py] [--steps=5]

Compares one train step of the same trunk with no heads, with K heads of each family, with K
parallel heads but the naive loss (all heads' full-vocabulary logits at once, kept for the backward
pass), and with the heads' losses computed at every 4th position (`mtp_head_loss_stride`). Step time
is the median of `--steps` timed steps after compilation; peak memory is XLA's buffer assignment for
the compiled step (arguments + outputs - aliased + temporaries), which does not depend on machine
noise. Prints ratios against the no-head trunk and writes results/train_cost.json.
"""

from __future__ import annotations

import statistics
import time

import benchmarks
from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/code_small.py', 'Model and batch config.')
flags.DEFINE_integer('steps', 5, 'Timed steps per variant.')
flags.DEFINE_integer('num_heads', 4, 'Heads in the MTP variants.')
flags.DEFINE_string('output', 'results/train_cost.json', 'Where to write the figures.')


def measure(config, mesh, steps):
  import jax
  import numpy as np
  from mtp.train import step as step_lib

  trainer = step_lib.Trainer(config, mesh)
  state = trainer.init_state()
  rng = np.random.default_rng(0)
  b, t = config.data.batch_size, config.data.seq_len
  batch = trainer.train_batch({
      'tokens': rng.integers(0, config.model.vocab_size, (b, t)).astype(np.int32),
      'segment_ids': np.ones((b, t), np.int32),
      'positions': np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)})
  compiled = trainer.train_step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times), peak, memory.temp_size_in_bytes


def main(argv):
  del argv
  from mtp.parallel import mesh as mesh_lib

  base = FLAGS.config
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1))
  k = FLAGS.num_heads
  chunk = base.loss_chunk_size
  # (name, heads, family, loss chunk size (0 = naive), head loss stride)
  variants = [('trunk only', 0, 'medusa', chunk, 1),
              (f'{k} parallel heads', k, 'parallel', chunk, 1),
              (f'{k} parallel heads, naive loss', k, 'parallel', 0, 1),
              (f'{k} parallel heads, stride 4', k, 'parallel', chunk, 4),
              (f'{k} medusa heads', k, 'medusa', chunk, 1),
              (f'{k} medusa heads, stride 4', k, 'medusa', chunk, 4),
              (f'{k} sequential heads', k, 'sequential', chunk, 1),
              ('trunk only, naive loss', 0, 'medusa', 0, 1)]
  rows = []
  for name, num_heads, head_type, chunk_size, stride in variants:
    config = base.copy_and_resolve_references()
    config.model.mtp_num_heads = num_heads
    config.model.mtp_head_type = head_type
    config.loss_chunk_size = chunk_size
    config.mtp_head_loss_stride = stride
    seconds, peak, temp = measure(config, mesh, FLAGS.steps)
    rows.append(dict(variant=name, step_seconds=seconds, peak_bytes=peak, temp_bytes=temp))
    print(f'measured {name}: {seconds:.3f} s/step, peak {peak / 2**20:.1f} MiB', flush=True)

  ref = rows[0]
  tokens = base.data.batch_size * base.data.seq_len
  print(f'\nbatch {base.data.batch_size}x{base.data.seq_len}, vocab {base.model.vocab_size}, '
        f'width {base.model.embed_dim}, {base.model.num_layers} layers')
  print(f'{"variant":<34} {"s/step":>8} {"tok/s":>8} {"time x":>7} {"peak MiB":>9} {"mem x":>6}')
  for r in rows:
    r['time_ratio'] = r['step_seconds'] / ref['step_seconds']
    r['memory_ratio'] = r['peak_bytes'] / ref['peak_bytes']
    r['tokens_per_sec'] = tokens / r['step_seconds']
    print(f'{r["variant"]:<34} {r["step_seconds"]:>8.3f} {r["tokens_per_sec"]:>8.0f} '
          f'{r["time_ratio"]:>7.2f} {r["peak_bytes"] / 2**20:>9.1f} {r["memory_ratio"]:>6.2f}')
  benchmarks.write_json(FLAGS.output, rows)


if __name__ == '__main__':
  app.run(main)
