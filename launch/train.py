r"""Trains an MTP model.

  python -m launch.train --config=configs/code_small.py --workdir=/tmp/mtp \
      [--config.num_train_steps=2000 --config.model.mtp_head_type=parallel ...]

Running it again with the same workdir resumes from the latest checkpoint, data position
included. Multi-host: pass --num_processes, --process_id and --coordinator_address (or rely on
the cluster's auto-detection by passing --num_processes=-1).

It fails with one line on stderr (the traceback too with --verbosity=1 or MTP_TRACEBACK=1) and
exit code 1 for errors, 2 for bad flags or config keys, 3 when training diverged and 143 when
preempted by SIGTERM or SIGUSR1 (after saving a checkpoint): see launch/cli.py. In a multi-host
run, a signal to any one process makes every process save the same step and exit with 143
(JAX's preemption service: mtp/train/preemption.py).
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import launch
from launch import cli

FLAGS = flags.FLAGS
PROGRAM = 'launch.train'
config_flags.DEFINE_config_file('config', None, 'Training config file.', lock_config=True)
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and the tokenizer go.')
flags.DEFINE_integer('num_processes', 1, 'Processes of a multi-host run (-1: auto-detect).')
flags.DEFINE_integer('process_id', None, 'This process in a multi-host run.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-host).')
flags.DEFINE_integer('heartbeat_timeout_s', 100,
                     'Multi-host: a process silent this long counts as dead, and the others '
                     'stop with an error instead of waiting for it forever.')
flags.DEFINE_integer('initialization_timeout_s', 300,
                     'Multi-host: how long processes wait for each other at start-up.')
flags.mark_flags_as_required(['config', 'workdir'])


def _initialize_distributed(jax) -> None:
  """Joins the multi-host run: the flags' place in it, or the cluster's (-1: TPU pod, SLURM,
  Open MPI auto-detection). A dead peer is noticed by the coordination service's heartbeats
  (every process then exits with an error) rather than waited for in a collective forever."""
  timeouts = dict(initialization_timeout=FLAGS.initialization_timeout_s,
                  heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_s)
  if FLAGS.num_processes == -1:
    jax.distributed.initialize(**timeouts)
  else:
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               **timeouts)
  logging.info('Process %d of %d.', jax.process_index(), jax.process_count())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}', exitcode=cli.USAGE)
  try:
    config = FLAGS.config
    config.get('seed')  # Loaded lazily: an unreadable file fails here.
  except Exception as e:  # noqa: BLE001
    cli.fail(PROGRAM, e, cli.USAGE)
  if FLAGS.num_processes == 0 or FLAGS.num_processes < -1:
    cli.fail(PROGRAM, ValueError(f'--num_processes must be -1 (auto-detect) or at least 1, got '
                                 f'{FLAGS.num_processes}.'), cli.USAGE)
  if FLAGS.num_processes > 1 and (FLAGS.process_id is None or not FLAGS.coordinator_address):
    cli.fail(PROGRAM, ValueError(f'--num_processes={FLAGS.num_processes} needs --process_id and '
                                 '--coordinator_address (or --num_processes=-1 where the cluster '
                                 'tells them).'), cli.USAGE)
  from mtp.checkpoint import paths  # pylint: disable=import-outside-toplevel  # No JAX.
  try:  # A scheme nothing serves, or gs:// without its client: named before JAX starts.
    paths.path_or_url(FLAGS.workdir, '--workdir')
    for key, value in (('config.data.source', config.data.get('source')),
                       ('config.init_from', config.get('init_from'))):
      if value:
        paths.path_or_url(value, key)
  except ValueError as e:
    cli.fail(PROGRAM, e)
  launch.quiet_library_logs()
  import jax  # After flags, so that XLA_FLAGS set by wrappers are honoured.
  if FLAGS.num_processes == -1 or FLAGS.num_processes > 1:
    _initialize_distributed(jax)
  from mtp.checkpoint import checkpointing
  from mtp.checkpoint import workdir_lock
  from mtp.train import divergence
  from mtp.train import preemption
  from mtp.train import trainer
  logging.info('JAX devices: %s', jax.devices())
  try:
    metrics = trainer.train_and_evaluate(config, FLAGS.workdir)
  except preemption.Preempted as e:
    cli.fail(PROGRAM, e, cli.PREEMPTED)
  except divergence.DivergenceError as e:
    cli.fail(PROGRAM, e, cli.DIVERGED)
  except (ValueError, KeyError, OSError, checkpointing.CheckpointError,
          workdir_lock.WorkdirLockedError) as e:
    cli.fail(PROGRAM, e)
  summary = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
  logging.info('Final metrics: %s', summary)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))
