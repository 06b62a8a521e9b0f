r"""Completes prompts with a trained model, writing one JSON object per prompt.

  python -m launch.generate --workdir=workdirs/code_small --prompt='def fib(n):' \
      --max_new_tokens=64 [--decoder=speculative|autoregressive] [--stream]
  python -m launch.generate --workdir=DIR --prompt_file=prompts.jsonl --batch_size=8 \
      --output=out.jsonl [--temperature=0.7 --top_p=0.9 --seed=1] [--tree=auto]

A prompt file holds one {"prompt": "..."} per line (UTF-8, a byte order mark and CRLF line ends
accepted; blank lines are skipped). Each output line
has `prompt`, `completion`, `tokens`, `num_steps` (forward passes of the decode loop),
`mean_accepted` (tokens per step), `accepted_histogram`, `tokens_per_sec` (excluding
compilation), `seconds`, `num_prompt_tokens` and `finish_reason`; without --output they go to
stdout. --stream prints each completion as its tokens are accepted (prompts in order).

--workdir may be an export directory (`launch.export`): a params export decodes as its
workdir would; a jax_export directory runs its serialized programs, with the decoder, tree and
sampling settings it was exported with (others are refused by name), and streams each
completion whole when it is done (the loop is one call).
"""

from __future__ import annotations

import atexit
import codecs
import json
import os
import pathlib
import sys
import tempfile

from absl import app
from absl import flags
from absl import logging

import launch
from launch import cli
from mtp.checkpoint import paths
from mtp.decode import trees
from mtp.decode import decoders

FLAGS = flags.FLAGS
PROGRAM = 'launch.generate'
flags.DEFINE_string('workdir', None, 'Trained workdir (checkpoints, config, tokenizer), or an '
                    'export directory of launch.export (params or jax_export).')
flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'], 'Weights and activations in '
                  'this precision (default: the workdir\'s). On CPU, bfloat16 verifies 8 '
                  'tokens for about 1.2x one token\'s cost (float32: 2x); decoding stays exact '
                  'against autoregressive decoding in that precision.')
flags.DEFINE_string('prompt', None, 'One prompt.')
flags.DEFINE_string('prompt_file', None, 'JSONL file, one {"prompt": "..."} per line (UTF-8, '
                    'with or without a BOM; LF or CRLF line ends).')
flags.DEFINE_integer('max_new_tokens', 128, 'Tokens to generate per prompt at most.')
flags.DEFINE_enum('decoder', decoders.DEFAULT, list(decoders.NAMES), 'Decoder: ' + '; '.join(
    f'{d.name}: {d.summary}' for d in decoders.DECODERS.values()) + '.')
flags.DEFINE_float('temperature', 0.0, '0 = greedy; else sampling temperature.')
flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens (0 = all).')
flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass in (0, 1] (1 = all).')
flags.DEFINE_integer('seed', 0, 'Sampling seed.')
flags.DEFINE_integer('batch_size', 1, 'Prompts decoded together.')
flags.DEFINE_string('tree', None, 'The heads\' candidates: ' + '; '.join(
    f'{name} ({what})' for name, what in trees.NAMES.items()) + '; or Medusa-style choices as '
    'JSON, e.g. "[[0], [1], [0, 0]]". Default: auto for the auto decoder (where validation '
    'code exists), chain for speculative.')
flags.DEFINE_integer('tree_budget', None, 'Nodes per step of a dynamic tree, root included '
                     '(--tree is then its superset; with --tree=dynamic, default: sized from '
                     'the heads\' measured accuracies and this hardware\'s cost curve).')
flags.DEFINE_integer('lookup', None, 'Drafting decoders: add a chain of this many '
                     'prompt-lookup drafts (copies of what followed the text\'s last tokens '
                     'before) to the tree. Default: 8 for auto (verified only where they look '
                     'likely to pass), 0 otherwise.')
flags.DEFINE_integer('draft_vocab', None, 'Drafting decoders: the heads draft over only the N '
                     'most frequent token ids of the training data (FR-Spec; counted once, cached '
                     'in the workdir); 0 = the whole vocabulary. Default: ' + '; '.join(
                         f'{d.draft_vocab} for {d.name} when the vocabulary holds at least '
                         f'{d.draft_vocab * decoders.LARGE_VOCAB_FACTOR} ids'
                         for d in decoders.DECODERS.values() if d.draft_vocab) +
                     ', else the whole vocabulary. Output is unchanged.')
flags.DEFINE_list('drafters', None, 'Drafting decoders: the drafters to mix, in order (names '
                  'of mtp.decode.plan.DRAFTERS: heads, lookup, ngram); default: the decoder\'s.')
flags.DEFINE_integer('logprobs', None, 'Also write each token\'s log-probability (0) and its k '
                     'most likely alternatives\' (k <= 20).')
flags.DEFINE_string('output', None, 'JSONL file to write (default: stdout).')
flags.DEFINE_bool('stream', False, 'Print completions as tokens are accepted.')
flags.DEFINE_integer('steps_per_chunk', None, 'Loop steps per host round trip when streaming.')
flags.mark_flag_as_required('workdir')


def read_prompt_file(path: str | pathlib.Path) -> list[str]:
  """Prompts from a JSONL file of {"prompt": "..."} objects; errors name the line.

  A UTF-8 byte order mark (Windows editors write one) starts the file, not its first prompt;
  a CRLF line end is whitespace after the object, like LF (a prompt's own carriage returns
  are JSON escapes, kept).
  """
  prompts = []
  path = paths.local_path(path, '--prompt_file')  # Local only: a URL is refused by name.
  with open(path, 'rb') as f:
    for number, raw in enumerate(f, 1):
      if number == 1:
        raw = raw.removeprefix(codecs.BOM_UTF8)
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ValueError(f'{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at '
                         f'column {e.start + 1})') from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{number}: not valid JSON ({e.msg}): {line.strip()[:80]!r}'
                         ) from None
      if not isinstance(record, dict) or not isinstance(record.get('prompt'), str):
        raise ValueError(f'{path}:{number}: expected an object with a "prompt" string, got '
                         f'{line.strip()[:80]!r}')
      prompts.append(record['prompt'])
  if not prompts:
    raise ValueError(f'{path} holds no prompts')
  return prompts


class OutputFile:
  """An output path checked up front and written atomically at the end.

  Creating the temporary sibling now proves the directory is writable before anything is
  decoded; `commit` renames it over the path, so a failed run never leaves half a file.
  """

  def __init__(self, path: str | pathlib.Path):
    self.path = paths.local_path(path, '--output')  # Local only: a URL is refused by name.
    if self.path.is_dir():
      raise ValueError(f'--output {self.path} is a directory; give a file path')
    self.path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f'.{self.path.name}.', suffix='.tmp',
                                    dir=self.path.parent)
    os.close(handle)
    self._tmp = pathlib.Path(name)
    atexit.register(self._tmp.unlink, missing_ok=True)  # Whatever happens before commit.

  def commit(self, text: str) -> None:
    self._tmp.write_text(text, encoding='utf-8')
    os.replace(self._tmp, self.path)


class OrderedPrinter:
  """Prints streamed text prompt by prompt in order: prompt i's text is live once prompts
  before it have finished; text that arrives earlier waits until then."""

  def __init__(self, prompts: list[str], out=None):
    self._prompts, self._out = prompts, out or sys.stdout
    self._pending = [''] * len(prompts)
    self._finished = [False] * len(prompts)
    self._current = 0
    self._started = False

  def __call__(self, index: int, text: str, finished: bool) -> None:
    self._pending[index] += text
    self._finished[index] |= finished
    while self._current < len(self._prompts):
      i = self._current
      if not self._started:
        self._out.write(f'=== prompt {i} ===\n{self._prompts[i]}')
        self._started = True
      self._out.write(self._pending[i])
      self._pending[i] = ''
      if not self._finished[i]:
        break
      self._out.write('\n')
      self._current += 1
      self._started = False
    self._out.flush()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}', exitcode=cli.USAGE)
  if (FLAGS.prompt is None) == (FLAGS.prompt_file is None):
    raise app.UsageError('Give exactly one of --prompt and --prompt_file.', exitcode=cli.USAGE)
  launch.quiet_library_logs()
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Checkpoint restore logs would bury the output.
  with cli.UserErrors(PROGRAM):
    prompts = ([FLAGS.prompt] if FLAGS.prompt is not None
               else read_prompt_file(FLAGS.prompt_file))
    tree = trees.parse(FLAGS.tree)
    # Before any decoding: an output that cannot be written would throw the run away.
    output = OutputFile(FLAGS.output) if FLAGS.output else None

    import mtp  # After flag parsing: importing JAX is slow.
    printer = OrderedPrinter(prompts) if FLAGS.stream else None
    loaded = mtp.load(FLAGS.workdir, dtype=FLAGS.dtype)
    generations = mtp.generate(
        loaded, prompts, max_new_tokens=FLAGS.max_new_tokens, decoder=FLAGS.decoder,
        temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed,
        tree=tree, lookup=FLAGS.lookup, batch_size=FLAGS.batch_size, on_text=printer,
        steps_per_chunk=FLAGS.steps_per_chunk, draft_vocab=FLAGS.draft_vocab,
        tree_budget=FLAGS.tree_budget, drafters=FLAGS.drafters, logprobs=FLAGS.logprobs)
    lines = ''.join(json.dumps(g.to_json(), ensure_ascii=False) + '\n' for g in generations)
    if output is not None:
      output.commit(lines)
  if output is None and not FLAGS.stream:
    sys.stdout.write(lines)
  total = sum(len(g.tokens) for g in generations)
  # Rows of a batch share its wall time: count each batch once.
  seconds = sum(g.seconds for g in generations[::FLAGS.batch_size])
  steps = sum(g.num_steps for g in generations)
  emitted = sum(g.mean_accepted * g.num_steps for g in generations)
  print(f'{FLAGS.decoder}: {len(generations)} prompts, {total} tokens in {seconds:.2f}s '
        f'({total / seconds:.1f} tokens/s), {emitted / max(steps, 1):.2f} tokens per loop step',
        file=sys.stderr)
  first_calls = [p.first_call_seconds for p in getattr(loaded, 'programs', ())
                 if p.first_call_seconds is not None]
  if first_calls:  # A jax_export artifact: what it costs before the timed runs.
    print(f'jax_export artifact: loaded in {loaded.load_seconds:.2f}s, first call (compilation '
          f'included) {first_calls[0]:.2f}s', file=sys.stderr)

if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
