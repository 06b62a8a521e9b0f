r"""XLA:CPU flags against the cost of a verification step, each set in its own process.

  python -m benchmarks.xla_flags [--model=smollm2|demo] [--block_sizes=1,5,8] \
      [--flag_sets=default,single_thread,...] [--batch_size=1]

XLA reads its flags once, when JAX starts, so every flag set runs `cost_model.measure_step_cost`
in a fresh process (`--worker`), alternating the sets for `--rounds` rounds (each round
starting from the next set) so that load from other processes falls on all of them alike; the
fastest round of each counts. The model is
SmolLM2's shape with random weights (float32; the weights are what a step reads, their values
do not matter) or the tiny demo shape. Prints seconds per step and each set's ratio to the
default, and writes results/xla_flags.json.

A flag set earns a place in the decoders' defaults only where it helps both one-token steps
(plain decoding, and `auto`'s fallback) and verification of a block, at every batch size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import benchmarks
from absl import app
from absl import flags

FLAG_SETS = {
    'default': '',
    # One thread per matmul: at batch 1 the matmuls are small, and handing them to Eigen's
    # thread pool may cost more than it saves.
    'single_thread_eigen': '--xla_cpu_multi_thread_eigen=false',
    # oneDNN's matmul kernels in place of XLA's own.
    'onednn': '--xla_cpu_experimental_onednn_custom_call=true',
    # XNNPACK (and its successor YNNPACK) kernels for dots; XNNPACK for whole subgraphs.
    'xnn_dot': '--xla_cpu_experimental_xnn_fusion_type=dot',
    'ynn_dot': '--xla_cpu_experimental_ynn_fusion_type=dot',
    'xnn_graph': '--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY',
    # The vector width the code generator prefers (AVX-512 where the CPU has it).
    'vector_512': '--xla_cpu_prefer_vector_width=512',
}

FLAGS = flags.FLAGS
flags.DEFINE_enum('model', 'smollm2', ['smollm2', 'demo'], 'The shape to measure.')
flags.DEFINE_list('block_sizes', ['1', '5', '8'], 'Tokens per verification step.')
flags.DEFINE_list('flag_sets', list(FLAG_SETS), f'Flag sets to compare: {list(FLAG_SETS)}.')
flags.DEFINE_integer('batch_size', 1, 'Rows per step.')
flags.DEFINE_integer('context', 256, 'Cached slots each new token attends to.')
flags.DEFINE_integer('rounds', 2, 'Rounds over the flag sets (the fastest counts).')
flags.DEFINE_string('worker', '', 'Internal: measure in this process, print JSON.')
flags.DEFINE_string('output', 'results/xla_flags.json', 'Where to write the figures.')

DEMO_SHAPE = dict(vocab_size=4096, embed_dim=256, num_layers=4, num_attention_heads=8,
                  num_kv_heads=4, head_dim=32, mlp_dim=768, max_seq_len=2048,
                  tie_embeddings=True)


def _model():
  from flax import nnx
  import benchmarks
  from mtp.model import mtp_model
  from mtp.model import transformer
  if FLAGS.model == 'smollm2':
    return benchmarks.random_model(tiny=False, dtype='float32')
  trunk = transformer.TransformerConfig(**DEMO_SHAPE)
  return mtp_model.MTPModel(mtp_model.ModelConfig(trunk=trunk, mtp_num_heads=4),
                            rngs=nnx.Rngs(0))


def _measure() -> dict[int, float]:
  from mtp.decode import cost_model
  return cost_model.measure_step_cost(
      _model(), [int(t) for t in FLAGS.block_sizes], batch_size=FLAGS.batch_size,
      context=FLAGS.context, repeats=3)


def _run_worker(name: str) -> dict[int, float]:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = ' '.join(x for x in (env.get('XLA_FLAGS', ''), FLAG_SETS[name]) if x)
  args = [sys.executable, '-m', 'benchmarks.xla_flags', f'--worker={name}',
          f'--model={FLAGS.model}', f'--block_sizes={",".join(FLAGS.block_sizes)}',
          f'--batch_size={FLAGS.batch_size}', f'--context={FLAGS.context}']
  run = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
  if run.returncode:
    return {'error': run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'failed'}
  return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def main(argv):
  del argv
  if FLAGS.worker:
    print(json.dumps(_measure()))
    return
  unknown = [n for n in FLAGS.flag_sets if n not in FLAG_SETS]
  if unknown:
    raise app.UsageError(f'unknown flag sets {unknown}; known: {list(FLAG_SETS)}')
  best: dict[str, dict] = {name: {} for name in FLAGS.flag_sets}
  for r in range(FLAGS.rounds):
    # Each round starts one set later: the first process of a round measured 15% slower.
    names = FLAGS.flag_sets[r % len(FLAGS.flag_sets):] + FLAGS.flag_sets[:r % len(FLAGS.flag_sets)]
    for name in names:
      got = _run_worker(name)
      if 'error' in got:
        best[name] = got
        continue
      previous = best.get(name, {})
      best[name] = {t: min(s, previous.get(t, float('inf'))) for t, s in got.items()}
  counts = [int(t) for t in FLAGS.block_sizes]
  print(f'\n{FLAGS.model} shape, float32, batch {FLAGS.batch_size}, {FLAGS.context} cached '
        f'slots: ms per verification step (ratio to default)')
  print(f'{"flag set":<22}' + ''.join(f'{"T=" + str(t):>18}' for t in counts))
  default = best.get('default', {})
  for name, costs in best.items():
    if 'error' in costs:
      print(f'{name:<22} failed: {costs["error"][:80]}')
      continue
    cells = []
    for t in counts:
      ratio = costs[t] / default[t] if t in default else float('nan')
      cells.append(f'{costs[t] * 1e3:>9.2f} ({ratio:4.2f}x)')
    print(f'{name:<22}' + ''.join(f'{c:>18}' for c in cells))
  benchmarks.write_json(FLAGS.output, {'model': FLAGS.model, 'batch_size': FLAGS.batch_size,
                                       'context': FLAGS.context, 'flag_sets': FLAG_SETS,
                                       'seconds_per_step': best})


if __name__ == '__main__':
  app.run(main)
