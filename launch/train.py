r"""Trains an MTP model.

  python -m launch.train --config=configs/code_small.py --workdir=/tmp/mtp \
      [--config.num_train_steps=2000 --config.model.mtp_head_type=parallel ...]

Running it again with the same workdir resumes from the latest checkpoint, data position
included. Multi-host: pass --num_processes, --process_id and --coordinator_address (or rely on
the cluster's auto-detection by passing --num_processes=-1).
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import launch

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Training config file.', lock_config=True)
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and the tokenizer go.')
flags.DEFINE_integer('num_processes', 1, 'Processes of a multi-host run (-1: auto-detect).')
flags.DEFINE_integer('process_id', None, 'This process in a multi-host run.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-host).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  launch.quiet_library_logs()
  import jax  # After flags, so that XLA_FLAGS set by wrappers are honoured.
  if FLAGS.num_processes == -1:
    jax.distributed.initialize()
  elif FLAGS.num_processes > 1:
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from mtp.train import trainer
  logging.info('JAX devices: %s', jax.devices())
  metrics = trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  summary = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
  logging.info('Final metrics: %s', summary)


if __name__ == '__main__':
  app.run(main)
