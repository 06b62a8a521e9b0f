"""Do the held-out prompts occur in a training corpus? Each prompt's text, searched verbatim.

  python -m benchmarks.heldout_overlap [--corpus=stdlib+stdlib_tests+stdlib_prose]

Every prompt of `benchmarks.heldout_prompts` (whitespace normalised: code indentation and line
breaks count as one space) is cut into windows of --window characters every --stride
characters, and each window is searched for in the corpus's text, normalised alike. Prints,
per prompt, how many of its windows occur; exits 1 if any prompt has more than
--max_fraction of them in the corpus. Licence headers and common idioms make a few windows
occur by chance; a copied file makes most of them occur.
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags

from benchmarks import heldout_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string('corpus', 'stdlib+stdlib_tests+stdlib_prose',
                    'A `data.corpus` value: named sources or directories joined by "+".')
flags.DEFINE_list('extensions', ['.py', '.txt'], 'File suffixes read from directories.')
flags.DEFINE_string('tokenizer', 'workdirs/smollm2', 'Workdir whose tokenizer cuts the prompts.')
flags.DEFINE_list('kinds', list(heldout_prompts.KINDS), 'Held-out prompt kinds.')
flags.DEFINE_integer('num_prompts', 24, 'Held-out prompts of each kind.')
flags.DEFINE_integer('prompt_tokens', 128, 'Prompts hold as many whole lines or sentences as fit.')
flags.DEFINE_integer('window', 60, 'Characters per window.')
flags.DEFINE_integer('stride', 15, 'Characters between window starts.')
flags.DEFINE_float('max_fraction', 0.2, 'Largest share of a prompt\'s windows that may occur.')


def normalise(text: str) -> str:
  """Runs of whitespace as one space."""
  return ' '.join(text.split())


def windows(text: str, width: int, stride: int) -> list[str]:
  """Windows of `width` characters starting every `stride` (the whole text if shorter)."""
  if len(text) <= width:
    return [text]
  return [text[i:i + width] for i in range(0, len(text) - width + 1, stride)]


def occurring(prompt: str, corpus_text: str, width: int, stride: int) -> tuple[int, int]:
  """(windows of the normalised `prompt` found in `corpus_text`, all its windows)."""
  cut = windows(normalise(prompt), width, stride)
  return sum(w in corpus_text for w in cut), len(cut)


def corpus_text(corpus: str, extensions) -> str:
  """The corpus's files, normalised and joined by newlines (no window spans two files)."""
  from mtp.data import corpora
  return '\n'.join(normalise(corpora.read_text(path))
                   for source in corpora.corpus_sources(corpus)
                   for path in corpora.source_files(source, tuple(extensions)))


def main(argv):
  del argv
  from mtp.data import tokenizer as tokenizer_lib
  tokenizer = tokenizer_lib.Tokenizer.load(FLAGS.tokenizer)
  text = corpus_text(FLAGS.corpus, FLAGS.extensions)
  print(f'{FLAGS.corpus}: {len(text) / 1e6:.1f}M characters; windows of {FLAGS.window} every '
        f'{FLAGS.stride}')
  worst = 0.0
  for kind in FLAGS.kinds:
    for i, prompt in enumerate(heldout_prompts.of_kind(kind, tokenizer, FLAGS.num_prompts,
                                                       FLAGS.prompt_tokens)):
      found, total = occurring(prompt, text, FLAGS.window, FLAGS.stride)
      worst = max(worst, found / total)
      print(f'{kind:5} {i:3} {found:3}/{total:<3} {normalise(prompt)[:60]!r}')
  print(f'largest share of a prompt\'s windows in the corpus: {worst:.2f}')
  if worst > FLAGS.max_fraction:
    print(f'heldout_overlap: a prompt has more than {FLAGS.max_fraction} of its windows in '
          f'{FLAGS.corpus}: it is not held out', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  app.run(main)
