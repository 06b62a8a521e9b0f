"""A run saved by two processes resumes in one on the same global batches: the data position
(global batches consumed) does not tie a restore to the process count."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from mtp import testing as mtp_testing
from mtp.data import prepare
from mtp.train import writers

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / 'tests' / 'data_position_worker.py'


def _run(workdir, num_processes, stop_after, source):
  port = portpicker.pick_unused_port()
  env = mtp_testing.child_env(PYTHONPATH=str(ROOT))
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes), str(port),
                             str(workdir), str(stop_after), str(source)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]


def _losses(workdir):
  return {r['step']: r['loss'] for r in writers.read_metrics(workdir) if 'loss' in r}


@pytest.mark.slow
def test_two_processes_save_one_resumes_on_the_same_batches(tmp_path):
  rng = np.random.default_rng(0)
  lines = [json.dumps({'text': f'def f{i}(x):\n' + '    x += 1\n' * int(rng.integers(0, 30))})
           for i in range(300)]
  (tmp_path / 'code.jsonl').write_text('\n'.join(lines) + '\n')
  dataset = tmp_path / 'ds'
  prepare.prepare(str(tmp_path / 'code.jsonl'), dataset, num_workers=1, shard_tokens=5000)
  _run(tmp_path / 'whole', 1, 4, dataset)
  _run(tmp_path / 'split', 2, 2, dataset)
  assert json.loads((tmp_path / 'split' / 'checkpoints' / '2' / 'data_position' / 'metadata')
                    .read_text()) == {'global_batches': 2}
  _run(tmp_path / 'split', 1, 4, dataset)  # Resumes at step 2 with one process.
  whole, split = _losses(tmp_path / 'whole'), _losses(tmp_path / 'split')
  assert sorted(whole) == sorted(split) == [1, 2, 3, 4]
  np.testing.assert_allclose([split[s] for s in range(1, 5)], [whole[s] for s in range(1, 5)],
                             rtol=1e-4)


def _iterator():
  from mtp.data import pipeline  # pylint: disable=g-import-not-at-top
  tokens = np.arange(40 * 4, dtype=np.int32).reshape(40, 4)
  return pipeline.make_train_iterator(
      {'tokens': tokens, 'segment_ids': np.ones_like(tokens), 'positions': np.zeros_like(tokens)},
      4, seed=0)


def test_a_checkpoint_holds_one_position_and_older_ones_still_restore(tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  from mtp.checkpoint import checkpointing  # pylint: disable=g-import-not-at-top
  params, opt_state = {'w': np.ones([2], np.float32)}, {'m': np.zeros([2], np.float32)}
  iterator = _iterator()
  for _ in range(3):
    next(iterator)
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  checkpointer.save(3, params, opt_state, iterator, force=True)
  checkpointer.close()
  step_dir = tmp_path / checkpointing.CHECKPOINT_DIRNAME / '3'
  assert json.loads((step_dir / 'data_position' / 'metadata').read_text()) == {
      'global_batches': 3}
  assert not list((step_dir / 'data_position').glob('process_*'))  # Not one per process.

  def restored_position():
    fresh = _iterator()
    reader = checkpointing.Checkpointer(tmp_path, read_only=True)
    try:
      reader.restore(3, data_iterator=fresh)
    finally:
      reader.close()
    return fresh.get_state()
  assert restored_position() == {'global_batches': 3}
  # A checkpoint from before: grain's handler wrote one file per process (of 2 here).
  shutil.rmtree(step_dir / 'data_position')
  (step_dir / 'data').mkdir()
  for p in range(2):
    (step_dir / 'data' / f'process_{p}-of-2.json').write_text('{"next_index": 3}')
  assert restored_position() == {'global_batches': 3}  # Read by a single process.
  shutil.rmtree(step_dir / 'data')
  with pytest.raises(checkpointing.CheckpointError, match='holds no data position'):
    restored_position()
