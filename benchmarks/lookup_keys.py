r"""How many prompt-lookup drafts greedy verification accepts, by the length of the matched key.

  python -m benchmarks.lookup_keys [--workdir=workdirs/code_small] [--num_prompts=8] \
      [--new_tokens=128] [--lookup=8]

The 'auto' decoder counts a row's lookup drafts as ready (`drafters.Drafter.ready`) only where
the key that matched (the n-gram whose earlier occurrence was copied) is at least
`drafters.lookup.MIN_KEY` tokens long. This measures what that threshold trades: the model
greedily continues prompts cut from the validation half of its own corpus that
`calibration.workdir_accuracies` does not read (unseen files, never the benchmarks' held-out
prompts), and at every position of each continuation the lookup drafts proposed there are
compared with the tokens that follow. Prints, for each key length, how often it occurs, the mean
number of the drafts accepted (the longest matching prefix) and how often all were.
"""

from __future__ import annotations

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/code_small', 'Trained workdir.')
flags.DEFINE_integer('num_prompts', 8, 'Prompts.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_integer('new_tokens', 128, 'Greedy tokens per continuation.')
flags.DEFINE_integer('lookup', 8, 'Lookup drafts per step.')


def accepted_by_key(sequences, starts, ends, lookup: int):
  """{key length: [accepted drafts at each position]} over the continuations.

  Args:
    sequences: [B, C] int tokens (prompt, then continuation).
    starts: [B] first continuation position: drafts are proposed from the position before it.
    ends: [B] end of each row's tokens.
    lookup: drafts per position.
  """
  import jax.numpy as jnp
  import numpy as np
  from mtp.decode.drafters import lookup as lookup_lib
  sequences = np.asarray(sequences)
  out: dict[int, list[int]] = {}
  for row in range(sequences.shape[0]):
    positions = np.arange(starts[row] - 1, ends[row] - 1)
    context = np.broadcast_to(sequences[row], (len(positions), sequences.shape[1]))
    drafts, keys = lookup_lib.propose_with_key(jnp.asarray(context), jnp.asarray(positions),
                                               lookup)
    drafts, keys = np.asarray(drafts), np.asarray(keys)
    for i, p in enumerate(positions):
      actual = sequences[row, p + 1:min(p + 1 + lookup, ends[row])]
      right = drafts[i, :len(actual)] == actual
      out.setdefault(int(keys[i]), []).append(int(np.cumprod(right).sum()))
  return out


def main(argv):
  del argv
  import launch
  launch.quiet_library_logs()
  import numpy as np
  import mtp
  from mtp.data import corpora
  from mtp.decode import calibration
  from mtp.decode import plan as plan_lib
  from mtp.decode import settings as settings_lib
  from mtp.decode import state as state_lib
  from mtp.decode.drafters import lookup as lookup_lib

  loaded = mtp.load(FLAGS.workdir)
  tokenizer = loaded.tokenizer
  files = corpora.corpus_splits(loaded.config.data)['valid'][1::2]
  prompts = [tokenizer.encode(p) for p in calibration.code_prompts(
      files, tokenizer, FLAGS.num_prompts, max_tokens=FLAGS.prompt_tokens,
      min_tokens=FLAGS.prompt_tokens // 2)]
  padded, lengths = state_lib.pad_prompts(prompts, tokenizer.pad_id)
  engine = plan_lib.resolve(loaded, 'autoregressive', max_new_tokens=FLAGS.new_tokens,
                            prompt_width=padded.shape[1], batch_size=len(prompts),
                            greedy_only=True)
  stop = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
  out = engine.generate(padded, lengths, engine.settings(
      [settings_lib.Sampling(max_tokens=FLAGS.new_tokens, stop_ids=stop)] * len(prompts)),
      pad_id=tokenizer.pad_id)
  sequences = np.full((len(prompts), padded.shape[1] + FLAGS.new_tokens), tokenizer.pad_id)
  ends = []
  for row, prompt in enumerate(prompts):
    n = int(out.num_generated[row])
    sequences[row, :len(prompt)] = prompt
    sequences[row, len(prompt):len(prompt) + n] = np.asarray(out.tokens[row, :n])
    ends.append(len(prompt) + n)
  table = accepted_by_key(sequences, [len(p) for p in prompts], ends, FLAGS.lookup)
  total = sum(len(v) for v in table.values())
  print(f'\n{FLAGS.workdir} (step {loaded.step}): {len(prompts)} validation prompts, '
        f'{FLAGS.new_tokens} greedy tokens each, {FLAGS.lookup} lookup drafts per position; '
        f'the threshold now: key >= {lookup_lib.MIN_KEY}')
  print(f'{"key length":>10} {"positions":>10} {"share":>6} {"accepted (mean)":>16} '
        f'{"all accepted":>13}')
  for key in sorted(table):
    accepted = np.asarray(table[key])
    print(f'{key:>10} {len(accepted):>10} {len(accepted) / total:>6.2f} '
          f'{accepted.mean():>16.2f} {np.mean(accepted == FLAGS.lookup):>13.2f}')


if __name__ == '__main__':
  app.run(main)
