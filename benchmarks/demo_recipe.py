r"""Choosing the demo's recipe: what each trained workdir gives on code it never saw.

  python -m benchmarks.demo_recipe --workdirs=workdirs/code_small,workdirs/other \
      [--prompt_chars=2000] [--new_tokens=128] [--num_prompts=8]

For each workdir (trained with `launch.train`, any config), on held-out code (installed packages
outside the standard library) and on the validation split of its own corpus:
- next-token loss and accuracy at the training length and, held out, at `--long_seq_len`
  (prompts of 2,000 characters need about 700 positions), and by position there;
- greedy completions of `--num_prompts` held-out prompts of `--prompt_chars` characters: how
  much of them is whitespace, how much repeats, whether prompt + completion still tokenizes as
  Python, and the first completion in full, for a reader;
- the heads' chain accuracies on those greedy continuations (what greedy verification accepts)
  and the tokens per step a chain of all heads would get from them;
- the training time, from the workdir's own `metrics.jsonl`.

Writes results/demo_recipe.json. The decoding speed of the chosen model is benchmarks/decode.py's
and the demo's business; this only compares models.
"""

from __future__ import annotations

import io
import tokenize

import benchmarks
from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('workdirs', ['workdirs/code_small'], 'Trained workdirs to compare.')
flags.DEFINE_integer('prompt_chars', 2000, 'Characters per held-out prompt (whole lines).')
flags.DEFINE_integer('new_tokens', 128, 'Greedy tokens per completion.')
flags.DEFINE_integer('num_prompts', 8, 'Held-out prompts.')
flags.DEFINE_integer('eval_batches', 8, 'Batches of 8 rows per next-token evaluation.')
flags.DEFINE_integer('long_seq_len', 1024, 'The longer evaluation length (0: skip).')
flags.DEFINE_string('output', 'results/demo_recipe.json', 'Where to write the figures.')


def training_seconds(records: list[dict], config) -> float:
  """Seconds of training steps, from the logged throughput (compilation and evals excluded)."""
  from mtp.train import long_context
  seconds, last_step = 0.0, 0
  for r in records:
    if 'tokens_per_sec' in r and r['tokens_per_sec'] > 0:
      data = (long_context.data_config(config) if long_context.in_phase(config, r['step'])
              else config.data)
      seconds += (r['step'] - last_step) * data.batch_size * data.seq_len / r['tokens_per_sec']
      last_step = r['step']
  return seconds


def still_tokenizes(text: str) -> bool:
  """True if Python's tokenizer reads `text` without error (unfinished blocks allowed)."""
  try:
    for _ in tokenize.generate_tokens(io.StringIO(text).readline):
      pass
  except (tokenize.TokenError, IndentationError, SyntaxError):
    # TokenError also covers an unfinished multi-line string or bracket at the very end,
    # which a cut completion may leave: count only errors before the last line.
    return _tokenizes_up_to_last_line(text)
  return True


def _tokenizes_up_to_last_line(text: str) -> bool:
  head = text[:text.rstrip('\n').rfind('\n') + 1]
  try:
    for _ in tokenize.generate_tokens(io.StringIO(head).readline):
      pass
  except tokenize.TokenError:
    return True  # An open bracket or string at the cut: not an error in what was written.
  except (IndentationError, SyntaxError):
    return False
  return True


def completion_stats(completions: list[str]) -> dict[str, float]:
  """Whitespace share, repeated-line share and how many are only whitespace."""
  chars = sum(len(c) for c in completions)
  space = sum(sum(ch.isspace() for ch in c) for c in completions)
  lines = [line.strip() for c in completions for line in c.splitlines() if line.strip()]
  return {
      'whitespace_fraction': space / max(chars, 1),
      'blank_completions': sum(not c.strip() for c in completions) / max(len(completions), 1),
      'repeated_line_fraction': 1 - len(set(lines)) / max(len(lines), 1),
  }


def evaluate(workdir: str) -> dict:
  import jax
  import mtp
  import numpy as np
  from flax import nnx
  from mtp.data import corpora
  from mtp.data import pipeline
  from mtp.decode import calibration
  from mtp.train import evaluation
  from mtp.train import writers

  loaded = mtp.load(workdir)
  config = loaded.config
  seq_len = config.data.seq_len
  heldout_texts = [corpora.read_text(p) for p in corpora.heldout_files()]
  valid_texts = pipeline.split_texts(config.data, 'valid')
  draft_ids = evaluation.trained_draft_ids(loaded)  # The heads' metrics over their own ids.
  result = {
      'workdir': workdir, 'step': loaded.step,
      'train_seconds': training_seconds(writers.read_metrics(workdir), config),
      'parameters': sum(x.size for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param))),
      'valid': evaluation.evaluate_texts(loaded.model, loaded.tokenizer, valid_texts, seq_len,
                                         max_batches=FLAGS.eval_batches, draft_ids=draft_ids),
      'heldout': evaluation.evaluate_texts(loaded.model, loaded.tokenizer, heldout_texts,
                                           seq_len, max_batches=FLAGS.eval_batches,
                                           draft_ids=draft_ids),
  }
  if FLAGS.long_seq_len:
    result['heldout_long'] = evaluation.evaluate_texts(
        loaded.model, loaded.tokenizer, heldout_texts, FLAGS.long_seq_len,
        max_batches=FLAGS.eval_batches, draft_ids=draft_ids)
    edges = [e for e in (0, 128, 256, 384, 512, 768, 1024, 2048) if e < FLAGS.long_seq_len]
    result['heldout_by_position'] = evaluation.loss_by_position(
        loaded.model, loaded.tokenizer, heldout_texts, FLAGS.long_seq_len,
        edges + [FLAGS.long_seq_len], max_batches=2)

  prompts = calibration.code_prompts(corpora.heldout_files(), loaded.tokenizer,
                                     FLAGS.num_prompts, max_tokens=10 * FLAGS.prompt_chars,
                                     min_tokens=FLAGS.prompt_chars // 8,
                                     max_chars=FLAGS.prompt_chars)
  generations = mtp.generate(loaded, prompts, max_new_tokens=FLAGS.new_tokens,
                             decoder='autoregressive', batch_size=len(prompts))
  completions = [g.completion for g in generations]
  result['prompt_tokens'] = float(np.mean([len(loaded.tokenizer.encode(p)) for p in prompts]))
  result['completions'] = completion_stats(completions)
  result['completions']['tokenize_fraction'] = float(np.mean(
      [still_tokenizes(p + c) for p, c in zip(prompts, completions)]))
  result['sample'] = {'prompt_tail': ''.join(prompts[0].splitlines(True)[-6:]),
                      'completion': completions[0]}
  if loaded.model.mtp_num_heads:
    tokens = [loaded.tokenizer.encode(p) for p in prompts]
    accuracy = calibration.calibrate(loaded.model, tokens, max_new_tokens=FLAGS.new_tokens,
                                     top_k=1, eos_id=loaded.tokenizer.eos_id,
                                     pad_id=loaded.tokenizer.pad_id)[:, 0]
    result['greedy_chain_accuracy'] = accuracy.tolist()
    result['chain_tokens_per_step'] = float(1 + np.cumprod(accuracy).sum())
  return result


def main(argv):
  del argv
  import launch
  launch.quiet_library_logs()
  results = [evaluate(w) for w in FLAGS.workdirs]
  print(f'\n{"workdir":<28} {"step":>5} {"train s":>7} {"valid acc":>9} {"held acc":>8} '
        f'{"held loss":>9} {"long loss":>9} {"space":>5} {"blank":>5} {"repeat":>6} '
        f'{"tokenizes":>9} {"chain tok/step":>14}')
  for r in results:
    c = r['completions']
    long_loss = r.get('heldout_long', {}).get('ntp_loss', float('nan'))
    print(f'{r["workdir"][-28:]:<28} {r["step"]:>5} {r["train_seconds"]:>7.0f} '
          f'{r["valid"]["ntp_acc"]:>9.3f} {r["heldout"]["ntp_acc"]:>8.3f} '
          f'{r["heldout"]["ntp_loss"]:>9.3f} {long_loss:>9.3f} {c["whitespace_fraction"]:>5.2f} '
          f'{c["blank_completions"]:>5.2f} {c["repeated_line_fraction"]:>6.2f} '
          f'{c["tokenize_fraction"]:>9.2f} {r.get("chain_tokens_per_step", 1.0):>14.2f}')
  if FLAGS.long_seq_len:
    buckets = results[0]['heldout_by_position']
    print(f'\nHeld-out next-token loss by position (rows of {FLAGS.long_seq_len}):\n'
          f'{"workdir":<28} ' + ' '.join(f'{b["start"]:>4}-{b["end"]:<4}' for b in buckets))
    for r in results:
      print(f'{r["workdir"][-28:]:<28} ' + ' '.join(
          f'{b["ntp_loss"]:>9.3f}' for b in r['heldout_by_position']))
  for r in results:
    print(f'\n== {r["workdir"]}: the first prompt\'s last lines, then >>> the completion\n'
          f'{r["sample"]["prompt_tail"]}>>>{r["sample"]["completion"]}')
  benchmarks.write_json(FLAGS.output, results)


if __name__ == '__main__':
  app.run(main)
