r"""Dynamic trees against static trees of the same size, side by side in one run.

  python -m benchmarks.dynamic_trees [--workdir=workdirs/code_small] [--budgets=3,4,6,8,12,16]
      [--kinds=code,prose]

For each budget N (nodes verified per step, root included), greedy, on held-out code prompts
(installed packages the model never saw; `--kinds=code,prose` adds held-out prose,
`benchmarks.heldout_prompts`), beside the heads' chain (every head's top-1):
  * static: the N-node tree built from the heads' measured top-k accuracies
    (`trees.tree_from_accuracies`, what tree='auto' builds), the same every step;
  * dynamic: every step and row, the N nodes of a 64-node superset that the heads' own
    probabilities rank first (`dynamic_trees`, tree='dynamic').
Which distribution a node's children come from is the family's (`HeadFamily.draft_tree`): head
d's for every node at depth d - 1 (Medusa-style heads), or, for EAGLE, the drafter's own at
that node (EAGLE-2), for static and dynamic trees alike.
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
from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir with MTP heads.')
flags.DEFINE_list('budgets', ['3', '4', '6', '8', '12', '16'], 'Tree sizes N to compare.')
flags.DEFINE_list('batch_sizes', ['1'], 'Batch sizes.')
flags.DEFINE_list('kinds', ['code'], 'Held-out prompt kinds: code, prose.')
flags.DEFINE_integer('draft_vocab', None, 'The drafting decoders\' draft vocabulary (0: every id; '
                     'default: the decoder\'s own).')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts.')
flags.DEFINE_integer('prompt_chars', 2000, 'Code prompts hold at most this many characters '
                     '(whole lines), as the demo reads; prose prompts at most a quarter as '
                     'many tokens (whole sentences).')
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
  prompts = {}
  for kind in FLAGS.kinds:
    if kind == 'code':
      prompts[kind] = calibration.code_prompts(
          corpora.heldout_files(), tokenizer, FLAGS.num_prompts, max_tokens=1024,
          min_tokens=FLAGS.prompt_chars // 16, max_chars=FLAGS.prompt_chars)
    else:
      prompts[kind] = heldout_prompts.of_kind(kind, tokenizer, FLAGS.num_prompts,
                                              FLAGS.prompt_chars // 4)
  lengths = {kind: [len(tokenizer.encode(p)) for p in texts] for kind, texts in prompts.items()}
  accuracies = calibration.workdir_accuracies(loaded)
  print(f'{FLAGS.workdir}: {loaded.model.mtp_num_heads} {loaded.model.cfg.mtp_head_type} heads; '
        + '; '.join(f'{len(prompts[k])} held-out {k} prompts of {min(n)}-{max(n)} tokens'
                    for k, n in lengths.items()) + f', {FLAGS.max_new_tokens} new', flush=True)
  runs = {'autoregressive': dict(decoder='autoregressive'),
          'chain': dict(decoder='speculative', tree='chain', lookup=0)}
  drafting = {} if FLAGS.draft_vocab is None else dict(draft_vocab=FLAGS.draft_vocab)
  runs['chain'].update(drafting)
  for n in (int(b) for b in FLAGS.budgets):
    runs[f'static {n}'] = dict(decoder='speculative',
                               tree=trees.tree_from_accuracies(accuracies, n), lookup=0,
                               **drafting)
    runs[f'dynamic {n}'] = dict(decoder='speculative', tree='dynamic', tree_budget=n,
                                **drafting)

  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  outputs = {(kind, b, name): [] for kind in prompts for b in batch_sizes for name in runs}
  for repeat in range(FLAGS.repeats):
    for kind, texts in prompts.items():
      for b in batch_sizes:
        for name, options in runs.items():
          gens = mtp.generate(loaded, texts, max_new_tokens=FLAGS.max_new_tokens,
                              batch_size=b, **options)
          outputs[kind, b, name].append(gens)
          print(f'  repeat {repeat + 1} {kind} batch {b} {name}: '
                f'{_tokens_per_sec(gens, b):.1f} tokens/s', flush=True)

  rows = []
  print(f'\n{"prompts":<7} {"batch":>5} {"decoder":<14} {"tok/step":>8} {"tokens/s":>9} '
        f'{"speedup":>8}  exact')
  for kind in prompts:
    for b in batch_sizes:
      reference = outputs[kind, b, 'autoregressive']
      for name in runs:
        gens = outputs[kind, b, name]
        speedups = [_tokens_per_sec(g, b) / _tokens_per_sec(r, b)
                    for g, r in zip(gens, reference)]
        exact = all(g.tokens == r.tokens for g, r in zip(gens[0], reference[0]))
        row = dict(kind=kind, batch_size=b, decoder=name,
                   tokens_per_step=_tokens_per_step(gens[0]),
                   tokens_per_sec=statistics.median(_tokens_per_sec(g, b) for g in gens),
                   speedup=statistics.median(speedups), exact=exact)
        rows.append(row)
        print(f'{kind:<7} {b:>5} {name:<14} {row["tokens_per_step"]:>8.2f} '
              f'{row["tokens_per_sec"]:>9.1f} {row["speedup"]:>7.2f}x  '
              f'{"yes" if exact else "NO"}')
  benchmarks.write_json(FLAGS.output, dict(
      workdir=FLAGS.workdir, step=loaded.step, prompt_tokens=lengths,
      family=loaded.model.cfg.mtp_head_type,
      max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
      head_accuracies=accuracies.tolist(), rows=rows))
  print(f'{time.perf_counter() - start:.0f}s in all')


if __name__ == '__main__':
  app.run(main)
