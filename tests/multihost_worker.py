"""One process of a localhost multi-host training run (driven by multihost_test.py).

  python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR NUM_STEPS
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # noqa: E402


def main():
  process_id, num_processes, port, workdir, num_steps = sys.argv[1:]
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=f'localhost:{port}',
                             num_processes=int(num_processes), process_id=int(process_id))
  from configs import tiny
  from mtp.train import trainer
  config = tiny.get_config()
  config.num_train_steps = int(num_steps)
  config.log_every_steps = 1
  config.eval_steps = 0
  config.checkpoint_every_steps = int(num_steps)
  trainer.train_and_evaluate(config, workdir)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main()
