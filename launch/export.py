r"""Exports a trained workdir for serving.

  python -m launch.export --workdir=workdirs/code_small --format=params --output=DIR \
      [--dtype=float32|bfloat16 (|float16 for hf)]
  python -m launch.export --workdir=W --format=jax_export --output=DIR [--max_new_tokens=256 \
      --tree=chain|default|JSON --lookup=0 --temperature=0.7 --top_k=0 --top_p=0.9 \
      --platforms=cpu,cuda,tpu]
  python -m launch.export --workdir=W --format=hf --output=DIR

Formats: params (a param-only Orbax checkpoint that mtp.load and launch.generate read), hf (a
Hugging Face Llama directory, heads in their serving systems' formats) and jax_export (the
whole generate function serialized with jax.export; launch.generate --workdir=DIR runs it).
The jax_export flags choose what the artifact bakes in (`mtp/export/jax_artifact.py`): the
most tokens per call, the speculative tree, and a sampling setting besides greedy.

W and DIR may be on Cloud Storage (gs://bucket/...). DIR must not exist: it is written to a
temporary sibling and renamed when complete (for a gs:// DIR: to a local directory, then
uploaded, export.json last). The summary (sizes, timings) is printed as JSON and kept in
DIR/export.json. Bad input fails with
one line on stderr and exit code 1 (2 for a bad flag): see launch/cli.py.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from launch import cli
from mtp.decode import trees

FLAGS = flags.FLAGS
PROGRAM = 'launch.export'
flags.DEFINE_string('workdir', None, 'Trained workdir, local or gs:// (heads on a frozen base '
                    'are merged).')
flags.DEFINE_string('format', None, 'params, hf or jax_export.')
flags.DEFINE_string('output', None, 'Directory to create, local or gs:// (it must not exist).')
flags.DEFINE_string('dtype', None, 'Parameter dtype in the export: float32 (default) or '
                    'bfloat16; float16 too for hf.')
# jax_export only.
flags.DEFINE_integer('max_new_tokens', None, 'jax_export: the most tokens one call generates '
                     '(default min(256, max_seq_len / 2)).')
flags.DEFINE_string('tree', None, 'jax_export: the speculative tree: chain (default), default, '
                    'or Medusa-style choices as JSON, e.g. "[[0], [1], [0, 0]]".')
flags.DEFINE_integer('lookup', 0, 'jax_export: prompt-lookup drafts in the greedy speculative '
                     'program.')
flags.DEFINE_float('temperature', 0.0, 'jax_export: also export sampled programs at this '
                   'temperature (0: greedy only).')
flags.DEFINE_integer('top_k', 0, 'jax_export, with --temperature: top-k of the sampled programs.')
flags.DEFINE_float('top_p', 1.0, 'jax_export, with --temperature: top-p of the sampled programs.')
flags.DEFINE_list('platforms', ['cpu', 'cuda', 'tpu'], 'jax_export: platforms to lower for '
                  '(those that fail to lower here are left out, and named).')
flags.mark_flags_as_required(['workdir', 'format', 'output'])

_ARTIFACT_FLAGS = ('max_new_tokens', 'tree', 'lookup', 'temperature', 'top_k', 'top_p',
                   'platforms')




def options() -> dict:
  """The jax_export flags given on the command line (the writer refuses them for others)."""
  given = {name: FLAGS[name].value for name in _ARTIFACT_FLAGS if FLAGS[name].present}
  if 'tree' in given:
    given['tree'] = trees.parse(given['tree'])
  return given


def main(argv):
  cli.begin(argv, warnings_only=True)
  with cli.UserErrors(PROGRAM):
    from mtp.export import writer  # pylint: disable=import-outside-toplevel
    summary = writer.export(FLAGS.workdir, FLAGS.format, FLAGS.output, dtype=FLAGS.dtype,
                            **options())
  sys.stdout.write(json.dumps(summary, indent=2) + '\n')
  details = summary[summary['format']]
  training = ''
  if 'training_checkpoint_bytes' in details:  # params: against what training keeps.
    training = (f' (its checkpoint {details["checkpoint_bytes"] / 1e6:.2f} MB, the training '
                f'checkpoint\'s {details["training_checkpoint_bytes"] / 1e6:.2f} MB)')
  print(f'{PROGRAM}: {summary["format"]} ({summary["dtype"]}) of step {summary["step"]} in '
        f'{summary["output"]}: {summary["bytes"] / 1e6:.2f} MB{training} in '
        f'{summary["seconds"]["total"]:.1f}s', file=sys.stderr)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
