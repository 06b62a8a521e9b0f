r"""Drafter families side by side: the same frozen trunk, data, steps and held-out prompts.

  python -m benchmarks.drafters                                  # trains a small trunk first
  python -m benchmarks.drafters --trunk=workdirs/code_small      # heads on a trained trunk

Reused: a workdir trained to the end by an earlier run (its training time is kept).

Each variant trains K heads of one family on the same frozen trunk (`init_from`,
optim.mode='frozen_trunk', self-distillation targets `--distill`, same steps and batch), with
`launch.train` as a user runs it. Then, on held-out code prompts (the first lines of code of
installed non-stdlib packages, never training data), chain decoding with all K heads against
the trunk's autoregressive decoding, batch 1, greedy and sampled (`--temperatures`): tokens per
loop step, the share of steps that accepted draft j, tokens/s and the speedup (medians over
`--repeats`, decoders taking turns within a repeat so machine load hits them alike;
compilation excluded), and, greedy, whether every output equals the autoregressive one.

Variants (`--variants`): 'medusa' (one ResBlock per head), 'sequential' (DeepSeek-V3 MTP
modules), and EAGLE drafters: 'eagle' (the family's defaults), 'eagle_trunk' (depth 1 trained
on the trunk's features only, EAGLE-1), 'eagle_w0' / 'eagle_w10' (feature-regression weight 0
or 10 instead of 1), 'eagle3' (EAGLE-3's fused features and input layer, no feature loss). The
EAGLE rows are the measurement behind the family's defaults.
Speculative Streaming: 'streaming' (γ stream embeddings alone), 'streaming_lora' /
'streaming_lora8' (with rank-1 / rank-8 adapters), 'streaming_finetune' (the paper's recipe:
the trunk fine-tuned with the streams).

Each row also gives the heads' own parameters and a drafting step's cost against a one-token
step (tokens per step over the speedup, both from the same run); `--batch_size` adds a greedy
row per variant decoding all prompts in batches of that size.

Prints a table and writes results/drafters.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from benchmarks import acceptance

FLAGS = flags.FLAGS
flags.DEFINE_string('root', 'workdirs/drafters', 'Where the workdirs go (reused when trained).')
flags.DEFINE_string('trunk', '', 'A trained workdir whose trunk the heads train on; empty: '
                    'train one under --root with --trunk_steps.')
flags.DEFINE_string('config', 'configs/code_small.py', 'Training config (the trunk\'s shape).')
flags.DEFINE_integer('trunk_steps', 300, 'Steps of the trunk trained when --trunk is empty.')
flags.DEFINE_list('variants', ['medusa', 'eagle', 'eagle_trunk', 'eagle_w0', 'eagle_w10'],
                  'Drafters to train and compare.')
flags.DEFINE_integer('num_heads', 4, 'K: heads (drafting depth) of every variant.')
flags.DEFINE_integer('steps', 150, 'Training steps of every variant.')
flags.DEFINE_enum('distill', 'teacher', ['text', 'teacher', 'rollout'],
                  'What the heads learn from (distill.targets).')
flags.DEFINE_list('overrides', ['data.max_corpus_bytes=1200000', 'distill.cache_trunk_states=True',
                                'mtp_head_loss_stride=4'],
                  'More --config.KEY=VALUE for every head run: by default the rows the steps '
                  'need, the frozen trunk run once over them, and the heads\' output layer at '
                  'every 4th position (each run then fits in a few minutes on 2 cores).')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('max_new_tokens', 96, 'Tokens generated per prompt.')
flags.DEFINE_integer('repeats', 2, 'Timed repeats (medians).')
flags.DEFINE_list('temperatures', ['0', '0.8'], 'Decoding temperatures: 0 is greedy (outputs '
                  'compared token for token); a weak trunk\'s greedy text can be degenerate (all '
                  'drafts then pass), which sampled decoding (exact rejection sampling) avoids.')
flags.DEFINE_integer('batch_size', 8, 'A second, batched measurement (greedy): all prompts in '
                     'batches of this size (0: none).')
flags.DEFINE_string('output', 'results/drafters.json', 'JSON results.')
flags.DEFINE_bool('train_only', False, 'Train the variants\' workdirs and stop (a later run '
                  'reuses them and measures every variant side by side).')

TIMING = 'drafters_timing.json'  # Written into a workdir once its training finished.
VARIANTS = {
    'medusa': {'model.mtp_head_type': 'medusa'},
    'sequential': {'model.mtp_head_type': 'sequential'},
    'eagle': {'model.mtp_head_type': 'eagle'},
    'eagle_trunk': {'model.mtp_head_type': 'eagle', 'model.eagle_train_features': 'trunk'},
    'eagle_w0': {'model.mtp_head_type': 'eagle', 'model.eagle_feature_loss_weight': 0.0},
    'eagle_w10': {'model.mtp_head_type': 'eagle', 'model.eagle_feature_loss_weight': 10.0},
    # EAGLE-3's drafter: fused features of three trunk layers, its input layer, no feature loss.
    'eagle3': {'model.mtp_head_type': 'eagle', 'model.eagle_features': 'fused',
               'model.eagle_input': 'concat', 'model.eagle_feature_loss_weight': 0.0},
    # Speculative Streaming: the trunk cache keeps the streamed layers' inputs too.
    'streaming': {'model.mtp_head_type': 'streaming'},
    'streaming_lora': {'model.mtp_head_type': 'streaming', 'model.streaming_adapter_rank': 1},
    # Adapters of some capacity: rank 8 on each streamed layer (more than 1% of Medusa's).
    'streaming_lora8': {'model.mtp_head_type': 'streaming', 'model.streaming_adapter_rank': 8},
    # The paper's recipe: the whole model fine-tuned with the streams (its own trunk moves, so
    # its autoregressive reference is its own).
    'streaming_finetune': {'model.mtp_head_type': 'streaming', 'optim.mode': 'finetune',
                           'distill.cache_trunk_states': False},
    # Trunk and heads trained together from scratch (the project's core shape), as long as
    # the shared trunk (`--trunk_steps`), on the text: each decodes against its own trunk.
    'joint_medusa': {'model.mtp_head_type': 'medusa'},
    'joint_streaming': {'model.mtp_head_type': 'streaming'},
    'joint_streaming_ns1': {'model.mtp_head_type': 'streaming', 'model.streaming_layers': 1},
    # The heads' losses weighted as the next token's (code_small weighs them 0.05): streams
    # have no layers of their own, so the shared ones learn them only as far as this says.
    'joint_medusa_w1': {'model.mtp_head_type': 'medusa', 'mtp_loss_scaling_factor': 1.0},
    'joint_streaming_ns1_w1': {'model.mtp_head_type': 'streaming', 'model.streaming_layers': 1,
                               'mtp_loss_scaling_factor': 1.0},
}
JOINT = {'init_from': '', 'optim.mode': 'joint', 'distill.targets': 'text',
         'distill.cache_trunk_states': False}


def train(workdir: pathlib.Path, overrides: dict) -> float:
  """Runs `launch.train`; returns its wall seconds. A workdir this benchmark already trained
  to the end is reused, with the seconds it took then (`TIMING`)."""
  timing = workdir / TIMING
  if timing.exists():
    return json.loads(timing.read_text())['train_seconds']
  command = [sys.executable, '-m', 'launch.train', f'--config={FLAGS.config}',
             f'--workdir={workdir}', '--config.progress_bar=False']
  command += [f'--config.{key}={value}' for key, value in overrides.items()]
  print('$ ' + ' '.join(command[1:]), flush=True)
  start = time.perf_counter()
  done = subprocess.run(command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True)
  if done.returncode:
    raise RuntimeError(f'training {workdir} failed:\n{done.stderr[-3000:]}')
  seconds = time.perf_counter() - start
  timing.write_text(json.dumps({'train_seconds': seconds}) + '\n')
  return seconds


def head_overrides(trunk: pathlib.Path, variant: str) -> dict:
  joint = variant.startswith('joint_')
  every = FLAGS.trunk_steps if joint else FLAGS.steps
  overrides = {'init_from': str(trunk), 'optim.mode': 'frozen_trunk',
          'distill.targets': FLAGS.distill, 'num_train_steps': every,
          'model.mtp_num_heads': FLAGS.num_heads, 'eval_every_steps': every,
          'checkpoint_every_steps': every, 'log_every_steps': max(1, every // 4),
          'optim.warmup_steps': max(1, every // 10),
          # The heads train on the trunk's rows at one length (the distill caches hold them).
          'long_context.steps': 0,
          **dict(item.split('=', 1) for item in FLAGS.overrides), **VARIANTS[variant]}
  if joint:  # The trunk's own recipe: its steps, warmup and data, no teacher.
    overrides.update(JOINT, **{'optim.warmup_steps': 50, 'data.max_corpus_bytes': -1,
                               'mtp_head_loss_stride': 4})
  return overrides


def share_trunk_cache(source: pathlib.Path, workdir: pathlib.Path) -> None:
  """Copies the first variant's trunk cache (the frozen trunk's targets over the same rows)
  into a new workdir: every variant reads the same rows from the same trunk, and the cache's
  key (rows, trunk, weights) makes training rebuild it if anything differed."""
  cache = source / 'trunk_cache'
  if source != workdir and cache.is_dir() and not (workdir / 'trunk_cache').exists():
    shutil.copytree(cache, workdir / 'trunk_cache', copy_function=os.link,  # Read only.
                    ignore=shutil.ignore_patterns('*.tmp'))


def last_eval(workdir: pathlib.Path) -> dict:
  """The final `eval_*` record of a run's metrics.jsonl."""
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  evals = [r for r in records if any(k.startswith('eval_') for k in r)]
  return evals[-1] if evals else {}


def tokens_per_sec(generations) -> float:
  return sum(len(g.tokens) for g in generations) / sum(g.seconds for g in generations)


def batch_tokens_per_sec(generations) -> float:
  """Throughput of batched generations (each timed over its whole batch): tokens over the
  summed wall time of the distinct batches."""
  batch_seconds = {g.seconds for g in generations}  # Rows of one batch share its time.
  return sum(len(g.tokens) for g in generations) / sum(batch_seconds)


def extra_parameters(model) -> int:
  """Parameters of the model's heads (the drafter's own; shared trunk weights not counted)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  heads = model.model.heads
  return 0 if heads is None else sum(x.size for x in jax.tree.leaves(nnx.state(heads,
                                                                             nnx.Param)))


def measure(workdirs: dict[str, pathlib.Path], prompts: list[str],
            temperature: float, batch_size: int = 1) -> dict[str, dict]:
  """Chain decoding of every variant against its trunk's autoregressive decoding."""
  import mtp  # pylint: disable=import-outside-toplevel
  loaded = {name: mtp.load(workdir) for name, workdir in workdirs.items()}
  runs = {name: {'autoregressive': [], 'chain': []} for name in loaded}
  rate = tokens_per_sec if batch_size == 1 else batch_tokens_per_sec
  for repeat in range(FLAGS.repeats):
    for name, model in loaded.items():
      for decoder in ('autoregressive', 'chain'):
        generations = mtp.generate(
            model, prompts, max_new_tokens=FLAGS.max_new_tokens, batch_size=batch_size,
            decoder='autoregressive' if decoder == 'autoregressive' else 'speculative',
            tree=None if decoder == 'autoregressive' else 'chain', temperature=temperature,
            seed=repeat)
        runs[name][decoder].append(generations)
        print(f'  repeat {repeat + 1}/{FLAGS.repeats} temperature {temperature} batch '
              f'{batch_size} {name} {decoder}: {rate(generations):.1f} tokens/s', flush=True)
  out = {}
  for name, run in runs.items():
    chain, reference = run['chain'], run['autoregressive']
    figures = acceptance.chain_figures(chain[0], reference[0])
    speedup = statistics.median(rate(c) / rate(r) for c, r in zip(chain, reference))
    tokens_per_step = figures['tokens_per_step']
    out[name] = dict(
        batch_size=batch_size,
        extra_parameters=extra_parameters(loaded[name]),
        tokens_per_step=tokens_per_step,
        draft_accepted_at_depth=figures['accepted_at_depth'],
        chain_tokens_per_sec=statistics.median(rate(g) for g in chain),
        autoregressive_tokens_per_sec=statistics.median(rate(g) for g in reference),
        speedup=speedup,
        # A drafting step's wall time against a one-token step's, from the same run: the
        # speedup is tokens per step over that ratio (prefills counted in both).
        step_cost=tokens_per_step / speedup,
        # Greedy: token for token. Sampled: equal in distribution only (not compared).
        outputs_match=figures['exact'] if temperature == 0 else None,
        distinct_tokens=len({t for g in reference[0] for t in g.tokens}))
  return out


def main(argv):
  del argv
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp.data import corpora  # pylint: disable=import-outside-toplevel
  from mtp.decode import calibration  # pylint: disable=import-outside-toplevel
  from mtp.decode import cost_model  # pylint: disable=import-outside-toplevel

  unknown = [v for v in FLAGS.variants if v not in VARIANTS]
  if unknown:
    raise app.UsageError(f'unknown variants {unknown}; known: {", ".join(VARIANTS)}')
  root = pathlib.Path(FLAGS.root)
  trunk_seconds = None
  if FLAGS.trunk:
    trunk = pathlib.Path(FLAGS.trunk)
  else:
    trunk = root / 'trunk'
    trunk_seconds = train(trunk, {'num_train_steps': FLAGS.trunk_steps,
                                  'model.mtp_num_heads': 0,
                                  'eval_every_steps': FLAGS.trunk_steps,
                                  'checkpoint_every_steps': FLAGS.trunk_steps})
  workdirs, seconds = {}, {}
  for variant in FLAGS.variants:
    steps = FLAGS.trunk_steps if variant.startswith('joint_') else FLAGS.steps
    workdirs[variant] = root / f'{variant}_k{FLAGS.num_heads}_{steps}'
    if FLAGS.distill != 'text':
      share_trunk_cache(workdirs[FLAGS.variants[0]], workdirs[variant])
    seconds[variant] = train(workdirs[variant], head_overrides(trunk, variant))
    print(f'  {variant}: trained in {seconds[variant]:.0f} s', flush=True)
  if FLAGS.train_only:
    return

  tokenizer = mtp.load(workdirs[FLAGS.variants[0]]).tokenizer
  prompts = calibration.code_prompts(corpora.heldout_files(), tokenizer, FLAGS.num_prompts,
                                     max_tokens=FLAGS.prompt_tokens,
                                     min_tokens=FLAGS.prompt_tokens // 2)
  print(f'{len(prompts)} held-out prompts, {FLAGS.max_new_tokens} new tokens each', flush=True)
  rows = []
  settings = [(float(t), 1) for t in FLAGS.temperatures]
  if FLAGS.batch_size > 1:
    settings.append((0.0, FLAGS.batch_size))
  for temperature, batch_size in settings:
    figures = measure(workdirs, prompts, temperature, batch_size)
    for variant in FLAGS.variants:
      evaluation = last_eval(workdirs[variant])
      rows.append(dict(
          variant=variant, temperature=temperature, workdir=str(workdirs[variant]),
          train_seconds=seconds[variant],
          eval_head_acc=[evaluation.get(f'eval_head_{k}_acc')
                         for k in range(1, FLAGS.num_heads + 1)],
          eval_acceptance_proxy=evaluation.get('eval_acceptance_proxy'), **figures[variant]))
  print(f'\n{"variant":<18} {"params":>8} {"temp":>5} {"batch":>5} {"train s":>8} '
        f'{"tokens/step":>12} {"step cost":>9} {"chain tok/s":>12} {"AR tok/s":>9} '
        f'{"speedup":>8} {"exact":>6} {"AR ids":>6}  eval head acc')
  for r in rows:
    accs = ' '.join(f'{a:.3f}' for a in r['eval_head_acc'] if a is not None)
    print(f'{r["variant"]:<18} {r["extra_parameters"]:>8} {r["temperature"]:>5} '
          f'{r["batch_size"]:>5} {r["train_seconds"]:>8.0f} '
          f'{r["tokens_per_step"]:>12.3f} {r["step_cost"]:>8.2f}x '
          f'{r["chain_tokens_per_sec"]:>12.1f} '
          f'{r["autoregressive_tokens_per_sec"]:>9.1f} {r["speedup"]:>7.2f}x '
          f'{str(r["outputs_match"]):>6} {r["distinct_tokens"]:>6}  {accs}')
  result = dict(trunk=str(trunk), trunk_train_seconds=trunk_seconds, config=FLAGS.config,
                num_heads=FLAGS.num_heads, steps=FLAGS.steps, distill=FLAGS.distill,
                overrides=FLAGS.overrides, num_prompts=len(prompts),
                max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
                decoder='chain of all heads', device=cost_model.device_kind(), rows=rows)
  output = pathlib.Path(FLAGS.output)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(result, indent=2) + '\n')
  print(f'wrote {output}')


if __name__ == '__main__':
  app.run(main)
