r"""What each kind of `auto` step costs on the compiled decode loop, beside an isolated pass.

  python -m benchmarks.loop_steps --workdir=workdirs/smollm2_demo --dtype=bfloat16
  python -m benchmarks.loop_steps --workdir=workdirs/smollm2_demo --batch_sizes=4 --repeats=9
  python -m benchmarks.loop_steps --batch_sizes=4 --exact --max_new_tokens=8064  # A server's.
  python -m benchmarks.loop_steps --batch_sizes=8 --sampled  # Rows that sample.

For each batch size, on held-out code prompts (`heldout_prompts`), the `auto` engine that
`mtp.generate` resolves for greedy rows (or, with --sampled, for rows that sample, timed on rows
at `engine.SAMPLED_TIMING`'s temperature and top-p), and each kind of its steps (0: one token;
k: the block of its first k drafters):
  * ms per step on the loop that decodes (`Engine.seconds_per_step`: the kind forced, rows
    never stopping), the fastest of --repeats runs of --steps steps, kinds taking turns;
  * ms per step of `cost_model.measure_step_cost`'s isolated loop over the same block: its
    verification pass and every node's logits (not the drafting, nor the loop's bookkeeping).

Check speed changes to decoding here, on the loop's own steps. Twice a change sped up the
isolated loop and not the decode loop, where the cache is the `while_loop`'s carry and each
kind's step a branch of its own: chunks read at static indices (auto's 10-node block at batch
4: 79-81 ms to 69-70 in the isolated loop, 81-86 ms to 83 on the loop); and packing a batch's
verification tokens gained 15% per step where the cost model's curve said 32%.

Prints a table and writes results/loop_steps.json.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/smollm2_demo', 'Trained workdir with a drafter.')
flags.DEFINE_string('dtype', 'bfloat16', 'Compute dtype the model is loaded in.')
flags.DEFINE_list('batch_sizes', ['1', '4'], 'Batch sizes to measure.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('max_new_tokens', 128, "The engine's token budget (sizes its cache).")
flags.DEFINE_integer('steps', 64, 'Loop steps per timed run.')
flags.DEFINE_integer('repeats', 5, 'Timed runs of each kind (the fastest counts).')
flags.DEFINE_bool('exact', False, "Rows mapped one by one, as the server's --exact decodes "
                  'them in float32 and off CPU (else one shared batch, as mtp.generate and the '
                  'server in bfloat16 on CPU decode them).')
flags.DEFINE_bool('sampled', False, 'Time rows that sample (`engine.SAMPLED_TIMING`), on the '
                  'engine that serves them, rather than greedy rows.')
flags.DEFINE_string('output', 'results/loop_steps.json', 'JSON results.')


def measure_batch(loaded, prompts: list[str], batch_size: int) -> list[dict]:
  """One row per kind of step of the `auto` engine at `batch_size`: ms on the decode loop and
  of the same block's verification pass alone."""
  from mtp.decode import cost_model
  from mtp.decode import plan as plan_lib
  from mtp.decode import state as state_lib
  tokenizer = loaded.tokenizer
  rows = (prompts * batch_size)[:batch_size]
  padded, lengths = plan_lib.check_prompts(
      *state_lib.pad_prompts(tokenizer.encode_batch(rows), tokenizer.pad_id),
      vocab_size=loaded.model.cfg.trunk.vocab_size)
  engine = plan_lib.resolve(loaded, 'auto', max_new_tokens=FLAGS.max_new_tokens,
                            prompt_width=padded.shape[1], batch_size=batch_size,
                            greedy_only=not FLAGS.sampled, calibration=(padded, lengths),
                            exact=FLAGS.exact)
  kinds = range(engine.plan.num_kinds + 1)
  nodes = {k: engine.plan.block(k)[0].num_nodes for k in kinds}

  def loop_seconds(kind):
    return engine.seconds_per_step(padded, lengths, kind=kind, steps=FLAGS.steps,
                                   sampled=FLAGS.sampled)

  for kind in kinds:  # Compiled once (each kind is data of one compiled loop) and warm.
    loop_seconds(kind)
  best = dict.fromkeys(kinds, float('inf'))
  for _ in range(FLAGS.repeats):  # Kinds take turns: load from other work hits them alike.
    for kind in kinds:
      best[kind] = min(best[kind], loop_seconds(kind))
  isolated = cost_model.measure_step_cost(
      loaded.model, sorted(set(nodes.values())), batch_size=batch_size,
      context=int(max(lengths)), repeats=FLAGS.repeats,
      blocks={nodes[k]: engine.plan.block(k)[0] for k in kinds})
  return [dict(batch_size=batch_size, kind=k, nodes=nodes[k], tokens=batch_size * nodes[k],
               loop_ms=best[k] * 1e3, isolated_ms=isolated[nodes[k]] * 1e3,
               loop_ratio=best[k] / best[0], isolated_ratio=isolated[nodes[k]] / isolated[1])
          for k in kinds]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import launch
  import mtp
  launch.quiet_library_logs()
  loaded = mtp.load(FLAGS.workdir, dtype=FLAGS.dtype)
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  prompts = heldout_prompts.of_kind('code', loaded.tokenizer, max(batch_sizes),
                                    FLAGS.prompt_tokens)
  rows = [row for b in batch_sizes for row in measure_batch(loaded, prompts, b)]
  print(f'{FLAGS.workdir} ({FLAGS.dtype}, {"mapped rows" if FLAGS.exact else "shared batch"}, '
        f'{"sampled" if FLAGS.sampled else "greedy"} rows, '
        f'{FLAGS.max_new_tokens} new tokens): ms per step of each kind, held-out code')
  print(f'{"batch":>5} {"kind":>4} {"nodes":>5} {"tokens":>6} {"loop ms":>8} {"isolated ms":>11} '
        f'{"loop / kind 0":>13} {"isolated / T1":>13}')
  for r in rows:
    print(f'{r["batch_size"]:>5} {r["kind"]:>4} {r["nodes"]:>5} {r["tokens"]:>6} '
          f'{r["loop_ms"]:>8.1f} {r["isolated_ms"]:>11.1f} {r["loop_ratio"]:>13.2f} '
          f'{r["isolated_ratio"]:>13.2f}')
  path = pathlib.Path(FLAGS.output)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(workdir=FLAGS.workdir, dtype=FLAGS.dtype, exact=FLAGS.exact,
                                  sampled=FLAGS.sampled,
                                  max_new_tokens=FLAGS.max_new_tokens, rows=rows),
                             indent=1) + '\n')
  print(f'wrote {path}')


if __name__ == '__main__':
  app.run(main)
