"""benchmarks.dynamic_trees: chains, static and dynamic trees side by side, every output exact."""

import json

from absl import flags
from absl.testing import flagsaver

from benchmarks import dynamic_trees

FLAGS = flags.FLAGS


@flagsaver.flagsaver
def test_every_decoder_is_measured_and_exact_on_each_kind(tiny_workdir, tmp_path):
  FLAGS.unparse_flags()
  FLAGS(['dynamic_trees', f'--workdir={tiny_workdir}', '--kinds=code,prose', '--budgets=3',
         '--num_prompts=2', '--prompt_chars=256', '--max_new_tokens=6', '--repeats=1',
         f'--output={tmp_path / "out.json"}'])
  dynamic_trees.main(['dynamic_trees'])
  rows = json.loads((tmp_path / 'out.json').read_text())['rows']
  assert [(r['kind'], r['decoder']) for r in rows] == [
      (kind, name) for kind in ('code', 'prose')
      for name in ('autoregressive', 'chain', 'static 3', 'dynamic 3')]
  assert all(r['exact'] and r['tokens_per_step'] >= 1.0 for r in rows)
  assert all(r['tokens_per_step'] == 1.0 for r in rows if r['decoder'] == 'autoregressive')
