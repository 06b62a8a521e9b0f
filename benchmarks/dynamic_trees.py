r"""Dynamic trees against static trees of the same size, side by side in one run.

  python -m benchmarks.dynamic_trees [--workdir=workdirs/code_small] [--budgets=3,4,6,8,12,16]

For each budget N (nodes verified per step, root included), greedy, on held-out code prompts
(installed packages the model never saw):
  * static: the N-node tree built from the heads' measured top-k accuracies
    (`trees.tree_from_accuracies`, what tree='auto' builds), the same every step;
  * dynamic: every step and row, the N nodes of a 64-node superset that the heads' own
    probabilities rank first (`dynamic_trees`, tree='dynamic').
It prints tokens per loop step, tokens/s and the speedup over autoregressive decoding at each
batch size, and checks that every output equals autoregressive decoding's. Decoders take turns
within each repeat (the machine's load hits them alike); figures are medians over repeats.

Writes results/dynamic_trees.json.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags

import benchmarks

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir with MTP heads.')
flags.DEFINE_list('budgets', ['3', '4', '6', '8', '12', '16'], 'Tree sizes N to compare.')
flags.DEFINE_list('batch_sizes', ['1'], 'Batch sizes.')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts.')
flags.DEFINE_integer('prompt_chars', 2000, 'Prompts hold at most this many characters (whole '
                     'lines), as the demo reads.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
flags.DEFINE_integer('repeats', 2, 'Timed repeats (medians).')
flags.DEFINE_string('output', 'results/dynamic_trees.json', 'JSON results.')


def _tokens_per_sec(generations, batch_size: int) -> float:
  seconds = sum(g.seconds for g in generations[::batch_size])
  return sum(len(g.tokens) for g in generations) / seconds


def _tokens_per_step(generations) -> float:
  steps = sum(g.num_steps for g in generations)
  emitted = sum(sum(j * c for j, c in enumerate(g.accepted_histogram)) for g in generations)
  return emitted / max(steps, 1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  import mtp
  from mtp.data import corpora
  from mtp.decode import calibration
  from mtp.decode import trees

  start = time.perf_counter()
  loaded = mtp.load(FLAGS.workdir)
  tokenizer = loaded.tokenizer
  prompts = calibration.code_prompts(corpora.heldout_files(), tokenizer, FLAGS.num_prompts,
                                     max_tokens=1024, min_tokens=FLAGS.prompt_chars // 16,
                                     max_chars=FLAGS.prompt_chars)
  lengths = [len(tokenizer.encode(p)) for p in prompts]
  accuracies = calibration.workdir_accuracies(loaded)
  print(f'{FLAGS.workdir}: {loaded.model.mtp_num_heads} {loaded.model.cfg.mtp_head_type} heads; '
        f'{len(prompts)} held-out prompts of {min(lengths)}-{max(lengths)} tokens, '
        f'{FLAGS.max_new_tokens} new', flush=True)
  runs = {'autoregressive': dict(decoder='autoregressive')}
  for n in (int(b) for b in FLAGS.budgets):
    runs[f'static {n}'] = dict(decoder='speculative',
                               tree=trees.tree_from_accuracies(accuracies, n), lookup=0)
    runs[f'dynamic {n}'] = dict(decoder='speculative', tree='dynamic', tree_budget=n)

  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  outputs = {(b, name): [] for b in batch_sizes for name in runs}
  for repeat in range(FLAGS.repeats):
    for b in batch_sizes:
      for name, options in runs.items():
        gens = mtp.generate(loaded, prompts, max_new_tokens=FLAGS.max_new_tokens,
                            batch_size=b, **options)
        outputs[b, name].append(gens)
        print(f'  repeat {repeat + 1} batch {b} {name}: {_tokens_per_sec(gens, b):.1f} '
              'tokens/s', flush=True)

  rows = []
  print(f'\n{"batch":>5} {"decoder":<14} {"tok/step":>8} {"tokens/s":>9} {"speedup":>8}  exact')
  for b in batch_sizes:
    reference = outputs[b, 'autoregressive']
    for name in runs:
      gens = outputs[b, name]
      speedups = [_tokens_per_sec(g, b) / _tokens_per_sec(r, b) for g, r in zip(gens, reference)]
      exact = all(g.tokens == r.tokens for g, r in zip(gens[0], reference[0]))
      row = dict(batch_size=b, decoder=name, tokens_per_step=_tokens_per_step(gens[0]),
                 tokens_per_sec=statistics.median(_tokens_per_sec(g, b) for g in gens),
                 speedup=statistics.median(speedups), exact=exact)
      rows.append(row)
      print(f'{b:>5} {name:<14} {row["tokens_per_step"]:>8.2f} {row["tokens_per_sec"]:>9.1f} '
            f'{row["speedup"]:>7.2f}x  {"yes" if exact else "NO"}')
  benchmarks.write_json(FLAGS.output, dict(
      workdir=FLAGS.workdir, step=loaded.step, prompt_tokens=lengths,
      max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
      head_accuracies=accuracies.tolist(), rows=rows))
  print(f'{time.perf_counter() - start:.0f}s in all')


if __name__ == '__main__':
  app.run(main)
