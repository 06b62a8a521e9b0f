"""Held-out acceptance against training tokens: the checkpoints of drafter runs, decoded.

Every kept checkpoint of each workdir drafts a chain of all its heads on held-out code and
prose (greedy, no prompt lookup, the whole vocabulary), and the run's tokens per step are
set against the tokens its drafter had trained on at that step:

  python -m benchmarks.data_scale --workdirs=hard=workdirs/eagle3_scale,soft=workdirs/eagle3_soft

Tokens trained on at step s are s * batch_size * seq_len (the positions the trunk's states
cover; the heads' losses count at every `mtp_head_loss_stride`-th of them), as their run's
config.json says. Each chain's output is checked against the trunk's own greedy decoding of
the same prompt, once per workdir (a frozen trunk is the same at every checkpoint).
Checkpoints of one run trained at a constant learning rate read as a curve; with a decaying
one, the early points are mid-schedule.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

import launch
from benchmarks import acceptance
from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_list('workdirs', None, 'NAME=WORKDIR pairs (or bare workdirs, named by their '
                  'directory): drafter runs whose kept checkpoints are decoded.', required=True)
flags.DEFINE_list('steps', [], 'Checkpoint steps to decode (default: every one kept).')
flags.DEFINE_list('kinds', list(heldout_prompts.KINDS), 'Held-out prompt kinds.')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts of each kind.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines or sentences as fit.')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
flags.DEFINE_string('output', 'results/data_scale.json', 'JSON results.')
flags.DEFINE_string('plot', 'results/data_scale.png', 'Plot ("" for none).')
flags.DEFINE_bool('keep_other_runs', True, 'Keep the rows --output already holds of runs and '
                  'checkpoints not measured now (a curve measured a few steps at a time).')


def parse_workdirs(specs: list[str]) -> dict[str, pathlib.Path]:
  """['name=dir' | 'dir', ...] -> {name: dir}; ValueError for a repeated name."""
  out: dict[str, pathlib.Path] = {}
  for spec in specs:
    name, _, path = spec.rpartition('=') if '=' in spec else ('', '', spec)
    path = pathlib.Path(path)
    name = name or path.name
    if name in out:
      raise ValueError(f'--workdirs names {name!r} twice')
    out[name] = path
  return out


def tokens_at(config: dict, step: int) -> int:
  """Training positions a run has read by `step` (batch rows times their length)."""
  return int(step) * int(config['data']['batch_size']) * int(config['data']['seq_len'])


def plot(rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  from mtp import plotting  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in dict.fromkeys(r['run'] for r in rows):
    for kind in dict.fromkeys(r['kind'] for r in rows):
      points = sorted((r['train_tokens'], r['tokens_per_step']) for r in rows
                      if r['run'] == name and r['kind'] == kind)
      ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], marker='o',
              label=f'{name}, {kind}')
  ax.set_xscale('log')
  ax.set_xlabel('training tokens (millions, log scale)')
  ax.set_ylabel('tokens per chain step (held-out, greedy)')
  ax.grid(alpha=0.3)
  ax.legend()
  plotting.save(fig, path, dpi=120)


def main(argv):
  del argv
  launch.quiet_library_logs()
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel

  runs = parse_workdirs(FLAGS.workdirs)
  rows = []
  for name, workdir in runs.items():
    config = json.loads((workdir / 'config.json').read_text())
    checkpointer = checkpointing.Checkpointer(workdir, read_only=True)
    try:
      kept = sorted(checkpointer.all_steps())
    finally:
      checkpointer.close()
    steps = [int(s) for s in FLAGS.steps] or kept
    missing = sorted(set(steps) - set(kept))
    if missing:
      raise ValueError(f'{workdir} keeps checkpoints {kept}, not {missing}')
    first = mtp.load(workdir, step=steps[0])
    prompts = {kind: heldout_prompts.of_kind(kind, first.tokenizer, FLAGS.num_prompts,
                                             FLAGS.prompt_tokens) for kind in FLAGS.kinds}
    references = {kind: mtp.generate(first, p, max_new_tokens=FLAGS.max_new_tokens,
                                     decoder='autoregressive') for kind, p in prompts.items()}
    del first
    for step in steps:
      model = mtp.load(workdir, step=step)
      for kind, p in prompts.items():
        generations = mtp.generate(model, p, max_new_tokens=FLAGS.max_new_tokens,
                                   decoder='speculative', tree='chain')
        row = dict(run=name, workdir=str(workdir), step=step, kind=kind,
                   train_tokens=tokens_at(config, step),
                   **acceptance.chain_figures(generations, references[kind]))
        rows.append(row)
        depths = ' '.join(f'{a:.3f}' for a in row['accepted_at_depth'])
        print(f'{name:<10} step {step:>5} {row["train_tokens"] / 1e6:>6.3f}M tokens {kind:<5} '
              f'{row["tokens_per_step"]:.3f} tokens/step, accepted at depth {depths}, '
              f'exact={row["exact"]}', flush=True)
  output = pathlib.Path(FLAGS.output)
  if FLAGS.keep_other_runs and output.exists():
    measured = {(r['run'], r['step']) for r in rows}
    rows = [r for r in json.loads(output.read_text())['rows']
            if (r['run'], r['step']) not in measured] + rows
  result = dict(num_prompts=FLAGS.num_prompts, prompt_tokens=FLAGS.prompt_tokens,
                max_new_tokens=FLAGS.max_new_tokens, decoder='chain of all heads, greedy',
                rows=rows)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(result, indent=2) + '\n')
  print(f'wrote {output}')
  if FLAGS.plot:
    plot(rows, pathlib.Path(FLAGS.plot))
    print(f'wrote {FLAGS.plot}')
  if not all(r['exact'] for r in rows):
    raise SystemExit('a chain output differs from greedy decoding')


if __name__ == '__main__':
  app.run(main)
