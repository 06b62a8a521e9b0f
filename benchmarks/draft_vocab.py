r"""Draft vocabularies (FR-Spec) side by side: what a smaller drafting projection saves and costs.

  python -m benchmarks.draft_vocab [--workdir=workdirs/code_small] [--sizes=256,512,1024,2048,0]
  python -m benchmarks.draft_vocab --temperature=0.8 --output=results/draft_vocab_t08.json
  python -m benchmarks.draft_vocab --workdir=workdirs/smollm2_eagle --decoder=auto \
      --kinds=code,prose --sizes=4096,8192,16384,0 --batch_sizes=1,4 --num_prompts=4

On a trained workdir, greedy (or sampled with --temperature), on held-out prompts of each of
--kinds (`heldout_prompts`: code of installed packages the model never saw, and prose of their
READMEs), for each batch size and each draft vocabulary size N (0: the whole vocabulary), the
--decoder ('speculative': a chain of all heads, or the --tree; 'auto': the default decoder with
its own tree and lookup drafts) drafting over N ids:
  * tokens per loop step, and how many of the autoregressive output's tokens lie inside the
    draft vocabulary (drafts of other tokens are impossible, an upper bound on acceptance);
  * seconds per drafting step of the chain (or --tree) relative to a one-token
    (autoregressive) step, timed on the compiled loops (`Engine.seconds_per_step`, greedy rows)
    over the first kind's prompts, in rounds where each loop takes its turn, the median ratio of
    --step_repeats rounds;
  * tokens/s and the speedup over autoregressive decoding; decoders take turns within each
    repeat so that machine load hits them alike; medians over --repeats;
  * greedy: whether every output equals the autoregressive one token for token.
The load average is printed before and after (the machine may be shared).

Prints a table and writes results/draft_vocab.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

from absl import app
from absl import flags

from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir with MTP heads.')
flags.DEFINE_list('sizes', ['256', '512', '1024', '2048', '0'],
                  'Draft vocabulary sizes (0: the whole vocabulary).')
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Batch sizes to measure.')
flags.DEFINE_list('kinds', ['code'], 'Held-out prompt kinds (code, prose).')
flags.DEFINE_enum('decoder', 'speculative', ['speculative', 'auto'],
                  "What drafts over each vocabulary: 'speculative' (the --tree) or 'auto' (the "
                  'default decoder, its own tree and lookup drafts).')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts of each kind.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
flags.DEFINE_integer('repeats', 3, 'Timed generation repeats (medians).')
flags.DEFINE_integer('step_repeats', 7, 'Rounds of step timings (the median ratio counts).')
flags.DEFINE_float('temperature', 0.0, '0: greedy (outputs are compared with autoregressive '
                   'decoding token for token); else sampled (same distribution, other draws).')
flags.DEFINE_string('tree', 'chain', "Candidates of --decoder=speculative (and of the timed "
                    "drafting step): 'chain' (every head's top-1) or 'default'.")
flags.DEFINE_string('output', 'results/draft_vocab.json', 'JSON results.')


def _tokens_per_sec(generations, batch_size: int) -> float:
  """All tokens over the summed wall time of the batches (rows of a batch share its time)."""
  seconds = sum(g.seconds for g in generations[::batch_size])
  return sum(len(g.tokens) for g in generations) / seconds


def _step_costs(loaded, prompts, batch_size: int, sizes: list[int], tree) -> dict[int, float]:
  """Seconds per drafting step / seconds per autoregressive step, per draft vocabulary size.

  Each step is timed on the compiled loop that decodes (`Engine.seconds_per_step`: greedy rows,
  the kind of step forced): the drafting step (kind 1) of a speculative engine drafting over
  N ids with `tree`, and the one-token step of the autoregressive engine."""
  from mtp.decode import plan as plan_lib
  from mtp.decode import state as state_lib

  tokenizer = loaded.tokenizer
  rows = (prompts * batch_size)[:batch_size]
  padded, lengths = state_lib.pad_prompts(tokenizer.encode_batch(rows), tokenizer.pad_id)
  # As mtp.generate resolves them: the same compiled loops.
  common = dict(max_new_tokens=FLAGS.max_new_tokens, batch_size=batch_size,
                prompt_width=padded.shape[1], greedy_only=not FLAGS.temperature)
  engines = {'one_token': (plan_lib.resolve(loaded, 'autoregressive', **common), 0)}
  for n in sizes:
    engines[n] = (plan_lib.resolve(loaded, 'speculative', tree=tree, lookup=0, draft_vocab=n,
                                   **common), 1)

  def seconds(engine, kind):
    return engine.seconds_per_step(padded, lengths, kind=kind)

  for config in engines.values():  # Compiled (and timed once, untimed) first.
    seconds(*config)
  # Rounds in which every loop takes its turn, so that load from other work hits them alike;
  # the median ratio over the rounds counts.
  ratios = {n: [] for n in sizes}
  one_token_runs = []
  for _ in range(FLAGS.step_repeats):
    timed = {key: seconds(*config) for key, config in engines.items()}
    one_token_runs.append(timed['one_token'])
    for n in sizes:
      ratios[n].append(timed[n] / timed['one_token'])
  out = {n: statistics.median(r) for n, r in ratios.items()}
  one_token = statistics.median(one_token_runs)
  out['one_token_seconds'] = one_token
  return out


def measure() -> dict:
  import mtp
  from mtp.decode import cost_model
  from mtp.decode import draft_vocab as draft_vocab_lib

  loaded = mtp.load(FLAGS.workdir)
  model, tokenizer = loaded.model, loaded.tokenizer
  vocab_size = model.cfg.trunk.vocab_size
  sizes = [int(s) for s in FLAGS.sizes]
  # A name of `trees.NAMES` for the plan; 'chain' is speculative's default, and None leaves
  # 'auto' its own tree.
  tree = None if FLAGS.tree == 'chain' else FLAGS.tree
  prompts = {kind: heldout_prompts.of_kind(kind, tokenizer, FLAGS.num_prompts,
                                           FLAGS.prompt_tokens) for kind in FLAGS.kinds}
  drafting = ('auto, its own tree and lookup' if FLAGS.decoder == 'auto'
              else f'speculative, tree {FLAGS.tree}')
  print(f'{FLAGS.workdir}: {model.mtp_num_heads} {model.cfg.mtp_head_type} heads, V='
        f'{vocab_size}, step {loaded.step}; ' + ', '.join(
            f'{len(p)} held-out {kind} prompts' for kind, p in prompts.items()) +
        f', {FLAGS.max_new_tokens} new tokens, {drafting}', flush=True)
  load_before = os.getloadavg()
  print(f'load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}',
        flush=True)
  start = time.perf_counter()
  counts_ids = draft_vocab_lib.draft_vocabulary(loaded, max(max(sizes), 1))  # Counts first.
  print(f'token counts ready in {time.perf_counter() - start:.1f}s', flush=True)
  del counts_ids

  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  names = ['autoregressive'] + [f'N={n or vocab_size}' for n in sizes]
  settings = {'autoregressive': ('autoregressive', None, None)}
  settings.update({f'N={n or vocab_size}': (FLAGS.decoder, tree, n) for n in sizes})
  runs = {(kind, b): {name: [] for name in names} for kind in prompts for b in batch_sizes}
  for repeat in range(FLAGS.repeats):
    for (kind, b), by_name in runs.items():
      for name in names:
        decoder, t, n = settings[name]
        gens = mtp.generate(loaded, prompts[kind], max_new_tokens=FLAGS.max_new_tokens,
                            decoder=decoder, tree=t, batch_size=b, draft_vocab=n,
                            temperature=FLAGS.temperature, seed=repeat)
        by_name[name].append(gens)
        print(f'  repeat {repeat + 1}/{FLAGS.repeats} {kind} batch {b} {name}: '
              f'{_tokens_per_sec(gens, b):.1f} tokens/s', flush=True)

  costs = {}
  first_kind = next(iter(prompts))
  for b in batch_sizes:
    costs[b] = _step_costs(loaded, prompts[first_kind], b, sizes, tree)
    print(f'  batch {b}: seconds per drafting step / one-token step: ' + ', '.join(
        f'N={n or vocab_size}: {costs[b][n]:.2f}' for n in sizes), flush=True)

  rows = []
  for (kind, b), by_name in runs.items():
    reference = by_name['autoregressive']
    reference_tokens = [t for g in runs[kind, batch_sizes[0]]['autoregressive'][0]
                        for t in g.tokens]
    for name in names:
      decoder, _, n = settings[name]
      gens = by_name[name]
      tps = [_tokens_per_sec(g, b) for g in gens]
      steps = sum(g.num_steps for g in gens[0])
      emitted = sum(sum(j * c for j, c in enumerate(g.accepted_histogram)) for g in gens[0])
      # Sampled outputs differ from autoregressive ones (other draws): nothing to compare.
      mismatches = (sum(g.tokens != r.tokens for g, r in zip(gens[0], reference[0]))
                    if not FLAGS.temperature else 0)
      row = dict(kind=kind, batch_size=b, decoder=name, draft_vocab=n or 0,
                 tokens_per_sec=statistics.median(tps),
                 speedup=statistics.median(
                     [_tokens_per_sec(g, b) / _tokens_per_sec(r, b)
                      for g, r in zip(gens, reference)]),
                 mean_accepted=emitted / max(steps, 1),
                 outputs_match=mismatches == 0 if not FLAGS.temperature else None,
                 mismatched_prompts=mismatches, tokens_per_sec_runs=tps)
      if decoder != 'autoregressive':
        size = n or vocab_size
        row['step_cost'] = costs[b][n or 0]
        ids = set(draft_vocab_lib.draft_vocabulary(loaded, size).tolist())
        row['reference_tokens_in_vocab'] = (sum(t in ids for t in reference_tokens) /
                                            max(len(reference_tokens), 1))
      rows.append(row)
  load_after = os.getloadavg()
  print(f'load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}')
  return dict(workdir=FLAGS.workdir, step=loaded.step, head_type=model.cfg.mtp_head_type,
              num_heads=model.mtp_num_heads, vocab_size=vocab_size, tree=FLAGS.tree,
              decoder=FLAGS.decoder, temperature=FLAGS.temperature,
              num_prompts={kind: len(p) for kind, p in prompts.items()},
              max_new_tokens=FLAGS.max_new_tokens,
              repeats=FLAGS.repeats, step_repeats=FLAGS.step_repeats,
              one_token_seconds={b: costs[b]['one_token_seconds'] for b in batch_sizes},
              load_average_before=load_before, load_average_after=load_after, rows=rows,
              device=cost_model.device_kind())


def print_table(result: dict) -> None:
  drafting = ('auto' if result['decoder'] == 'auto'
              else f'speculative, {result["tree"]}')
  print(f'\n{result["workdir"]} ({result["num_heads"]} {result["head_type"]} heads, '
        f'V={result["vocab_size"]}), held-out prompts ' + ', '.join(
            f'{n} {kind}' for kind, n in result['num_prompts'].items()) + ', '
        f'{"temperature %g" % result["temperature"] if result["temperature"] else "greedy"}, '
        f'{drafting}, {result["max_new_tokens"]} new tokens, median of {result["repeats"]}')
  print(f'{"kind":<6} {"batch":>5}  {"decoder":<15} {"in vocab":>8} {"tok/step":>8} '
        f'{"step cost":>9} {"tokens/s":>9} {"speedup":>7}  exact')
  for r in result['rows']:
    in_vocab = (f'{r["reference_tokens_in_vocab"]:.3f}' if 'reference_tokens_in_vocab' in r
                else '-')
    cost = f'{r["step_cost"]:.2f}x' if 'step_cost' in r else '1.00x'
    print(f'{r["kind"]:<6} {r["batch_size"]:>5}  {r["decoder"]:<15} {in_vocab:>8} '
          f'{r["mean_accepted"]:>8.2f} {cost:>9} {r["tokens_per_sec"]:>9.1f} '
          f'{r["speedup"]:>6.2f}x  {_exact(r)}')
  print('in vocab: share of the autoregressive output\'s tokens inside the draft vocabulary; '
        'step cost: seconds per drafting step (the chain, or the tree) / one-token step')


def _exact(row: dict) -> str:
  if row['outputs_match'] is None:
    return '-'
  return 'yes' if row['outputs_match'] else f'NO ({row["mismatched_prompts"]})'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  result = measure()
  print_table(result)
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(result, indent=1))
  print(f'\nwrote {output} ({time.perf_counter() - start:.0f}s)')


if __name__ == '__main__':
  app.run(main)
