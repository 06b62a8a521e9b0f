"""benchmarks.loop_steps end to end on a tiny trained model."""

import json

import pytest
from absl import flags
from absl.testing import flagsaver

from benchmarks import loop_steps

FLAGS = flags.FLAGS


@pytest.mark.slow
@pytest.mark.parametrize('sampled', [False, True])
@flagsaver.flagsaver
def test_every_kind_is_timed_on_the_loop_and_in_isolation(tiny_workdir, tmp_path, sampled):
  out = tmp_path / 'loop_steps.json'
  batch_sizes = (2,) if sampled else (1, 2)
  FLAGS.unparse_flags()
  FLAGS(['loop_steps', f'--workdir={tiny_workdir}', '--dtype=float32',
         f'--batch_sizes={",".join(map(str, batch_sizes))}', f'--sampled={sampled}',
         '--prompt_tokens=64', '--max_new_tokens=8', '--steps=4', '--repeats=1',
         '--exact', f'--output={out}'])
  loop_steps.main(['loop_steps'])
  result = json.loads(out.read_text())
  rows = result['rows']
  assert result['exact'] and result['sampled'] == sampled  # Mapped rows, as a server's.
  for b in batch_sizes:
    kinds = [r for r in rows if r['batch_size'] == b]
    assert [r['kind'] for r in kinds] == list(range(len(kinds))) and len(kinds) >= 2
    assert kinds[0]['nodes'] == 1 and kinds[0]['loop_ratio'] == kinds[0]['isolated_ratio'] == 1
    for r in kinds:
      assert r['loop_ms'] > 0 and r['isolated_ms'] > 0 and r['tokens'] == b * r['nodes']
    assert all(a['nodes'] < z['nodes'] for a, z in zip(kinds, kinds[1:]))  # Larger blocks.
