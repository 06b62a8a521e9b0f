"""Two localhost processes (jax.distributed, gloo) train like one process on the same batches."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / 'tests' / 'multihost_worker.py'


def _run(workdir, num_processes, steps=3):
  port = portpicker.pick_unused_port()
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop('XLA_FLAGS', None)
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes), str(port),
                             str(workdir), str(steps)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  _run(tmp_path / 'one', 1)
  _run(tmp_path / 'two', 2)
  one = [r['loss'] for r in writers.read_metrics(tmp_path / 'one') if 'loss' in r]
  two = [r['loss'] for r in writers.read_metrics(tmp_path / 'two') if 'loss' in r]
  assert len(one) == len(two) == 3
  np.testing.assert_allclose(two, one, rtol=1e-4)
  assert (tmp_path / 'two' / 'checkpoints' / '3').is_dir()
