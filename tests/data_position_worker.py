"""One process of a localhost training run that may stop early (driven by
data_position_test.py).

  python tests/data_position_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR STOP_AFTER SOURCE

Trains configs/tiny.py for 4 steps (checkpoint every 2) on SOURCE (a prepared dataset, or '' for
the in-memory corpus), stopping after step STOP_AFTER as if preempted.
"""

import os
import sys

# One CPU device a process; the test session's fast-compiling XLA flags and compilation cache
# carry over (`mtp.testing.child_env`): set here, the flags made each run compile at full cost.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402


def main():
  process_id, num_processes, port, workdir, stop_after, source = sys.argv[1:]
  if int(num_processes) > 1:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address=f'localhost:{port}',
                               num_processes=int(num_processes), process_id=int(process_id))
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from mtp.train import trainer  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.num_train_steps = 4
  config.log_every_steps = 1
  config.eval_steps = 0
  config.checkpoint_every_steps = 2
  config.data.source = source
  trainer.train_and_evaluate(config, workdir, stop_after_step=int(stop_after))
  if int(num_processes) > 1:
    jax.distributed.shutdown()


if __name__ == '__main__':
  main()
