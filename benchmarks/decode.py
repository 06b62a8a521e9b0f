r"""Speculative decoding against autoregressive decoding, side by side in one run.

  python -m benchmarks.decode [--workdir=workdirs/code_small] [--repeats=3]
  python -m benchmarks.decode --workdirs=wd/medusa,wd/parallel,wd/sequential   # each family

On a trained workdir, greedy, on held-out code prompts (the first lines of code of installed
packages the model never saw, cut at a line boundary):
  * the measured cost of one verification pass over T tokens, relative to T = 1, at batch 1
    and batch 8 (`cost_model.measure_step_cost`);
  * the heads' conditional top-k accuracies, measured on the trunk's greedy continuations of
    prompts from the training corpus's validation files (other code than the test prompts);
  * for batch sizes 1 and 8 and each decoder (autoregressive; 'auto', the default, which
    drafts its default tree (the tree 'auto' builds from the same accuracies and the cached
    cost curve, where the heads' accuracies can be measured) plus lookup drafts where the text
    repeats, each kind of drafting step stopping where it does not pay, and 'auto' without
    lookup; speculative with a chain of all heads, the static default tree, a tree built from
    the accuracies with its size chosen from that batch size's cost curve, that tree with
    --lookup prompt-lookup drafts beside it, and a dynamic tree of that many nodes): mean
    accepted tokens per loop step, tokens/s and the speedup over autoregressive decoding.
    Decoders take turns within each repeat, so machine load hits them alike; figures are
    medians over repeats. Compilation is excluded (`mtp.generate` warms up first).
  * whether every speculative output equals the autoregressive one token for token.

Prints a table, writes results/decode.json and a plot results/decode.png.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir.')
flags.DEFINE_list('workdirs', None, 'Several workdirs (e.g. one per head family): figures for '
                  'each and a side-by-side summary. Overrides --workdir.')
flags.DEFINE_enum('prompt_source', 'heldout', ['heldout', 'valid'],
                  'heldout: installed non-stdlib packages (another code style); valid: the '
                  'training corpus\'s validation files (unseen files, the training style).')
flags.DEFINE_integer('num_prompts', 8, 'Prompts.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('prompt_chars', 0, 'If > 0, prompts also hold at most this many characters '
                     '(the demo reads 2,000 with --prompt_tokens=1024).')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Batch sizes to measure.')
flags.DEFINE_integer('repeats', 3, 'Timed repeats per decoder and batch size (medians).')
flags.DEFINE_list('token_counts', ['1', '2', '3', '4', '5', '6', '8', '12', '16', '24', '32'],
                  'Verification sizes T of the cost curve.')
flags.DEFINE_integer('lookup', 8, 'Prompt-lookup drafts beside the accuracy tree in one more '
                     'row (0: no such row).')
flags.DEFINE_string('output', 'results/decode.json', 'JSON results.')
flags.DEFINE_string('plot', 'results/decode.png', 'Plot.')


def measure_workdir(workdir: str) -> dict:
  """All figures for one workdir."""
  import numpy as np
  import mtp
  from mtp.data import corpora
  from mtp.decode import calibration
  from mtp.decode import cost_model
  from mtp.decode import trees

  loaded = mtp.load(workdir)
  model, tokenizer = loaded.model, loaded.tokenizer
  head_type, num_heads = model.cfg.mtp_head_type, model.mtp_num_heads
  print(f'\n== {workdir}: {num_heads} {head_type} heads, step {loaded.step}', flush=True)
  if FLAGS.prompt_source == 'heldout':
    files = corpora.heldout_files()
  else:
    # The half of the validation files that workdir_accuracies does not calibrate on.
    files = corpora.corpus_splits(loaded.config.data)['valid'][1::2]
  prompts = calibration.code_prompts(files, tokenizer, FLAGS.num_prompts,
                                     max_tokens=FLAGS.prompt_tokens,
                                     min_tokens=(FLAGS.prompt_chars // 16 if FLAGS.prompt_chars
                                                 else FLAGS.prompt_tokens // 2),
                                     max_chars=FLAGS.prompt_chars or None)
  prompt_lengths = [len(tokenizer.encode(p)) for p in prompts]
  print(f'{len(prompts)} {FLAGS.prompt_source} prompts of {min(prompt_lengths)}-'
        f'{max(prompt_lengths)} tokens, {FLAGS.max_new_tokens} new tokens each', flush=True)

  accuracies = calibration.workdir_accuracies(loaded)
  print('head accuracies (rows: heads 1..D, columns: top-k rank, given the earlier drafts were '
        'right):\n' + np.array2string(accuracies, precision=3), flush=True)

  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  token_counts = sorted({int(t) for t in FLAGS.token_counts} | {1})
  cost = {}
  for b in batch_sizes:
    seconds = cost_model.measure_step_cost(model, token_counts, batch_size=b)
    cost[b] = dict(seconds=seconds, relative=cost_model.relative(seconds))
    print(f'cost of verifying T tokens at batch {b} (x T=1): ' + ', '.join(
        f'{t}: {c:.2f}' for t, c in cost[b]['relative'].items()), flush=True)

  default_tree = trees.medusa_default_tree(num_heads)
  # name: (decoder, tree, lookup[, tree_budget]); lookup None: the decoder's default ('auto':
  # 8 drafts; 'speculative': none, the heads draft alone).
  decoders = {b: {'autoregressive': ('autoregressive', None, None),
                  'auto (own tree + lookup)': ('auto', None, None),
                  'auto heads only (own tree)': ('auto', None, 0),
                  f'chain of {num_heads}': ('speculative', None, None),
                  f'default tree ({default_tree.num_nodes})': ('speculative', default_tree, None)}
              for b in batch_sizes}
  auto_trees = {}
  for b in batch_sizes:
    auto_trees[b] = cost_model.choose_tree(model, accuracies, cost=cost[b]['relative'])
    decoders[b][f'accuracy tree ({auto_trees[b].num_nodes})'] = (
        'speculative', auto_trees[b], None)
    budget = auto_trees[b].num_nodes
    decoders[b][f'dynamic tree ({budget} of 64)'] = ('speculative', 'dynamic', 0, budget)
    if FLAGS.lookup:
      decoders[b][f'accuracy tree + lookup ({auto_trees[b].num_nodes} + {FLAGS.lookup})'] = (
          'speculative', auto_trees[b], FLAGS.lookup)

  runs = {b: {name: [] for name in decoders[b]} for b in batch_sizes}
  for repeat in range(FLAGS.repeats):
    for b in batch_sizes:
      for name, (decoder, tree, lookup, *budget) in decoders[b].items():
        generations = mtp.generate(loaded, prompts, max_new_tokens=FLAGS.max_new_tokens,
                                   decoder=decoder, tree=tree, lookup=lookup, batch_size=b,
                                   tree_budget=budget[0] if budget else None)
        runs[b][name].append(generations)
        print(f'  repeat {repeat + 1}/{FLAGS.repeats} batch {b} {name}: '
              f'{_tokens_per_sec(generations, b):.1f} tokens/s', flush=True)

  rows = []
  for b in batch_sizes:
    reference = runs[b]['autoregressive']
    for name, (decoder, tree, lookup, *budget) in decoders[b].items():
      gens = runs[b][name]
      tps = [_tokens_per_sec(g, b) for g in gens]
      speedups = [_tokens_per_sec(g, b) / _tokens_per_sec(r, b) for g, r in zip(gens, reference)]
      steps = sum(g.num_steps for g in gens[0])
      emitted = sum(sum(j * c for j, c in enumerate(g.accepted_histogram)) for g in gens[0])
      mismatches = sum(g.tokens != r.tokens for g, r in zip(gens[0], reference[0]))
      row = dict(batch_size=b, decoder=name, tokens_per_sec=statistics.median(tps),
                 speedup=statistics.median(speedups), mean_accepted=emitted / max(steps, 1),
                 outputs_match=mismatches == 0, mismatched_prompts=mismatches,
                 tokens_per_sec_runs=tps)
      if budget:
        row['tree_nodes'] = budget[0]
        row['verify_cost'] = float(np.interp(budget[0], list(cost[b]['relative']),
                                             list(cost[b]['relative'].values())))
      elif tree is not None:
        row['tree_nodes'] = tree.num_nodes + (lookup or 0)  # A block: heads' nodes + lookup's.
        row['tree_choices'] = [list(c) for c in tree.choices]
      # 'auto' picks its own tree and drafts lookup only where it is ready (`plan.resolve`,
      # `decode.auto`): no fixed block to predict or cost.
      if decoder == 'speculative' and not budget:
        heads_tree = tree or trees.chain_tree(num_heads)
        if (not lookup and heads_tree.max_depth <= accuracies.shape[0]
            and max(heads_tree.topk_per_depth) <= accuracies.shape[1]):
          row['predicted_accepted'] = 1 + trees.expected_accepted_length(heads_tree, accuracies)
        row['verify_cost'] = float(np.interp(heads_tree.num_nodes + (lookup or 0),
                                             list(cost[b]['relative']),
                                             list(cost[b]['relative'].values())))
      rows.append(row)
  batch_equal = None
  if len(batch_sizes) > 1:
    first, *others = [runs[b]['autoregressive'][0] for b in batch_sizes]
    batch_equal = all([g.tokens for g in first] == [g.tokens for g in o] for o in others)
  return dict(workdir=str(workdir), step=loaded.step, head_type=head_type, num_heads=num_heads,
              prompt_source=FLAGS.prompt_source, num_prompts=len(prompts),
              prompt_tokens=prompt_lengths,
              max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
              head_accuracies=accuracies.tolist(),
              cost_curve={b: {k: {str(t): v for t, v in c.items()} for k, c in cost[b].items()}
                          for b in batch_sizes},
              auto_trees={b: [list(c) for c in t.choices] for b, t in auto_trees.items()},
              autoregressive_equal_across_batch_sizes=batch_equal, rows=rows,
              device=cost_model.device_kind())


def _tokens_per_sec(generations, batch_size: int) -> float:
  """All tokens over the summed wall time of the batches (rows of a batch share its time)."""
  seconds = sum(g.seconds for g in generations[::batch_size])
  return sum(len(g.tokens) for g in generations) / seconds


def print_table(result: dict) -> None:
  print(f'\n{result["workdir"]} ({result["num_heads"]} {result["head_type"]} heads, step '
        f'{result["step"]}), {result["num_prompts"]} {result["prompt_source"]} prompts, greedy, '
        f'{result["max_new_tokens"]} new tokens, median of {result["repeats"]}')
  print(f'{"batch":>5}  {"decoder":<32} {"tok/step":>8} {"predicted":>9} {"T cost":>6} '
        f'{"tokens/s":>9} {"speedup":>7}  exact')
  for r in result['rows']:
    predicted = f'{r["predicted_accepted"]:.2f}' if 'predicted_accepted' in r else '-'
    cost = f'{r["verify_cost"]:.2f}' if 'verify_cost' in r else '-'
    print(f'{r["batch_size"]:>5}  {r["decoder"]:<32} {r["mean_accepted"]:>8.2f} {predicted:>9} '
          f'{cost:>6} {r["tokens_per_sec"]:>9.1f} {r["speedup"]:>6.2f}x  '
          f'{"yes" if r["outputs_match"] else "NO (%d)" % r["mismatched_prompts"]}')
  if result['autoregressive_equal_across_batch_sizes'] is not None:
    print('autoregressive outputs equal across batch sizes: '
          f'{result["autoregressive_equal_across_batch_sizes"]}')


def print_summary(results: list[dict]) -> None:
  print('\nHead families side by side (best speculative decoder per batch size):')
  print(f'{"workdir":<32} {"heads":<12} {"batch":>5} {"decoder":<32} {"tok/step":>8} '
        f'{"speedup":>7}')
  for result in results:
    for b in sorted({r['batch_size'] for r in result['rows']}):
      spec = [r for r in result['rows'] if r['batch_size'] == b and
              r['decoder'] != 'autoregressive']
      best = max(spec, key=lambda r: r['speedup'])
      print(f'{result["workdir"][-32:]:<32} {result["num_heads"]} {result["head_type"]:<10} '
            f'{b:>5} {best["decoder"]:<32} {best["mean_accepted"]:>8.2f} '
            f'{best["speedup"]:>6.2f}x')


def plot(results: list[dict], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from mtp import plotting
  fig, axes = plt.subplots(len(results), 3, figsize=(16, 4.2 * len(results)), squeeze=False)
  for (ax_cost, ax_acc, ax_speed), result in zip(axes, results):
    title = f'{pathlib.Path(result["workdir"]).name} ({result["head_type"]})'
    for b, curves in result['cost_curve'].items():
      t = [int(k) for k in curves['relative']]
      ax_cost.plot(t, list(curves['relative'].values()), 'o-', label=f'batch {b}')
    ax_cost.plot([1, 32], [1, 32], 'k:', alpha=0.4, label='linear')
    ax_cost.set(xscale='log', yscale='log', xlabel='tokens verified per pass (T)',
                ylabel='cost / cost(T=1)', title=f'{title}: verification cost')
    ax_cost.legend(fontsize=8)
    batch_sizes = sorted({r['batch_size'] for r in result['rows']})
    names = list(dict.fromkeys(r['decoder'].split(' (')[0] for r in result['rows']))
    width = 0.8 / len(batch_sizes)
    for i, b in enumerate(batch_sizes):
      rows = {r['decoder'].split(' (')[0]: r for r in result['rows'] if r['batch_size'] == b}
      x = [j + i * width for j in range(len(names))]
      ax_acc.bar(x, [rows[n]['mean_accepted'] for n in names], width, label=f'batch {b}')
      ax_speed.bar(x, [rows[n]['speedup'] for n in names], width, label=f'batch {b}')
    for ax, label in ((ax_acc, 'tokens per loop step'), (ax_speed, 'speedup vs autoregressive')):
      ax.set_xticks([j + width * (len(batch_sizes) - 1) / 2 for j in range(len(names))])
      ax.set_xticklabels(names, fontsize=8)
      ax.axhline(1.0, color='k', lw=0.8)
      ax.set(ylabel=label, title=f'{title}: {label}')
      ax.legend(fontsize=8)
  plotting.save(fig, path)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  workdirs = FLAGS.workdirs or [FLAGS.workdir]
  results = []
  for workdir in workdirs:
    results.append(measure_workdir(workdir))
    print_table(results[-1])
  if len(results) > 1:
    print_summary(results)
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
  plot(results, pathlib.Path(FLAGS.plot))
  print(f'\nwrote {output} and {FLAGS.plot} ({time.perf_counter() - start:.0f}s)')


if __name__ == '__main__':
  app.run(main)
