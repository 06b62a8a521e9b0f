r"""Would Speculative Streaming's early-exit tree pruning pay on this machine?

  python -m benchmarks.streaming_pruning \
      --workdirs=workdirs/drafters/streaming_k4_150,workdirs/drafters/medusa_k4_150

The paper (arXiv 2402.11131, section 3.3) drafts a larger tree than it verifies in full: at
layer L - N_s the main stream's early-exit logits score every node, and the nodes they find
unlikely skip the top N_s layers (their main stream and their streams). Pruning a tree of n
nodes to n/2 so saves less than cost(n) - cost(n/2): the bottom layers still run every node,
and the early-exit logits cost an output-layer projection per node. This measures a
verification step's wall time with trees of n nodes (the heads' tree, on the compiled loop that
decodes: `Engine.seconds_per_step`; streams of every node included) against a one-token step of
the same engine, batch 1 and `--batch_size`, and prints that bound as a share of cost(n).
Workdirs with other heads (Medusa's) give their costs beside it, for comparison.

Prints a table and writes results/streaming_pruning.json.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('workdirs', ['workdirs/drafters/streaming_k4_150',
                                'workdirs/drafters/medusa_k4_150'],
                  'Workdirs with heads (streaming ones get the pruning bound).')
flags.DEFINE_list('nodes', ['2', '4', '8', '16', '32'], 'Tree sizes n (root included).')
flags.DEFINE_integer('batch_size', 8, 'A second, batched measurement.')
flags.DEFINE_integer('steps', 32, 'Timed steps per measurement.')
flags.DEFINE_integer('repeats', 3, 'Repeats (minimum).')
flags.DEFINE_string('output', 'results/streaming_pruning.json', 'JSON results.')


def main(argv):
  del argv
  import numpy as np  # pylint: disable=import-outside-toplevel
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp.decode import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from mtp.decode import trees  # pylint: disable=import-outside-toplevel

  rows = []
  for workdir in FLAGS.workdirs:
    loaded = mtp.load(workdir)
    cfg = loaded.model.cfg
    layers, depth = cfg.trunk.num_layers, cfg.mtp_num_heads
    streamed = cfg.options['streaming_layers'] if cfg.mtp_head_type == 'streaming' else 0
    # A Medusa-shaped tree of n nodes over every head's top 4 (accuracies falling with depth
    # and rank: the shape, not the figures, matters for the cost).
    accuracies = np.array([[0.6, 0.15, 0.08, 0.05]]) ** np.arange(1, depth + 1)[:, None] ** 0.5
    for batch in (1, FLAGS.batch_size):
      prompts = np.full((batch, 64), 7, np.int32)
      lengths = np.full(batch, 64, np.int32)
      costs = {}
      for n in [int(x) for x in FLAGS.nodes]:
        tree = trees.tree_from_accuracies(accuracies, n)
        # `auto` (told that drafting always pays: nothing measured) runs either kind of step
        # on one compiled loop: kind 1 verifies the heads' tree, kind 0 one token.
        engine = plan_lib.resolve(loaded, 'auto', max_new_tokens=FLAGS.steps * 2 + 8,
                                  batch_size=batch, tree=tree, lookup=0, drafters=['heads'],
                                  break_even=0.0)
        engine.seconds_per_step(prompts, lengths, kind=1, steps=4)  # Compiles.
        one = min(engine.seconds_per_step(prompts, lengths, kind=0, steps=FLAGS.steps)
                  for _ in range(FLAGS.repeats))
        costs[n] = min(engine.seconds_per_step(prompts, lengths, kind=1, steps=FLAGS.steps)
                       for _ in range(FLAGS.repeats)) / one
        print(f'  {workdir} batch {batch}: tree of {n} nodes {costs[n]:.2f}x a one-token '
              'step', flush=True)
      for n, cost in costs.items():
        half = costs.get(n // 2)
        saving = None if half is None or not streamed else (cost - half) / cost
        rows.append(dict(workdir=workdir, family=cfg.mtp_head_type, layers=layers,
                         streamed=streamed, batch_size=batch, nodes=n, step_cost=cost,
                         pruning_bound=saving))
  print(f'\n{"family":<10} {"N_s/L":>5} {"batch":>5} {"nodes":>6} {"step cost":>10} '
        f'{"pruning to n/2 saves under":>30}')
  for r in rows:
    bound = '' if r['pruning_bound'] is None else f'{100 * r["pruning_bound"]:.1f}%'
    share = f'{r["streamed"]}/{r["layers"]}' if r['streamed'] else ''
    print(f'{r["family"]:<10} {share:>5} {r["batch_size"]:>5} {r["nodes"]:>6} '
          f'{r["step_cost"]:>9.2f}x {bound:>30}')
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(dict(workdirs=FLAGS.workdirs, rows=rows), indent=2) + '\n')
  print(f'wrote {output}')


if __name__ == '__main__':
  app.run(main)
