r"""Converts a workdir's checkpoint between the scanned and unrolled layer layouts.

  python -m launch.convert_layout --workdir=workdirs/run --output=workdirs/run_scanned \
      --scan_layers=true

Training resumes a workdir only in the layout it was saved in (`model.scan_layers`); this
writes a new workdir, the latest checkpoint's parameters and optimizer state converted and the
data position kept, which `launch.train --workdir=OUTPUT --config.model.scan_layers=...`
resumes. Loading, generation, export and `init_from` need no conversion: they read either.
OUTPUT is locked (`OUTPUT.lock`, as training locks its workdir) while it is written: a second
conversion to it is refused. Failures print one line and exit with 1 (2 for bad flags):
launch/cli.py.
"""

import sys

from absl import app
from absl import flags

from launch import cli

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'The workdir to convert (only read).')
flags.DEFINE_string('output', None, 'The new workdir (must not exist).')
flags.DEFINE_bool('scan_layers', None, 'The layout to write: true = scanned, false = unrolled.')
flags.mark_flags_as_required(['workdir', 'output', 'scan_layers'])


def main(argv):
  cli.begin(argv)
  # After flag parsing: JAX is slow to import.
  from mtp.checkpoint import convert_layout  # pylint: disable=import-outside-toplevel
  try:
    step = convert_layout.convert_workdir(FLAGS.workdir, FLAGS.output, FLAGS.scan_layers)
  except (RuntimeError, ValueError, OSError) as e:
    cli.fail('launch.convert_layout', e)
  print(f'Wrote {FLAGS.output}: step {step} of {FLAGS.workdir}, layers '
        f'{"scanned" if FLAGS.scan_layers else "unrolled"}. Resume it with --workdir='
        f'{FLAGS.output} --config.model.scan_layers={FLAGS.scan_layers}.', file=sys.stderr)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser('launch.convert_layout'))
