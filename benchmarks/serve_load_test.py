"""benchmarks.serve_load in its tiny mode: a 2-step model, few short requests per level."""

import json

from absl import flags
from absl.testing import flagsaver

from benchmarks import serve_load
from mtp.serving import testing

FLAGS = flags.FLAGS


@flagsaver.flagsaver
def test_tiny_run_writes_figures_and_a_plot(tmp_path):
  workdir = testing.tiny_workdir(tmp_path / 'wd')
  out = tmp_path / 'results'
  FLAGS.unparse_flags()
  FLAGS(['serve_load', f'--workdir={workdir}', '--concurrency=1,8,32', '--requests=32',
         '--num_prompts=4', '--prompt_tokens=24', '--max_tokens=6',
         f'--output={out}/serve_load.json', f'--plot={out}/serve_load.png'])
  serve_load.main(['serve_load'])
  result = json.loads((out / 'serve_load.json').read_text())
  rows = {(r['concurrency'], r['decoder']): r for r in result['rows']}
  assert set(rows) == {(c, d) for c in (1, 8, 32) for d in serve_load.DECODERS}
  for row in rows.values():
    assert row['errors'] == 0 and row['tokens_per_sec'] > 0
    assert row['p99_latency_s'] >= row['p50_latency_s'] > 0
  for c in (1, 8, 32):
    assert rows[c, 'speculative']['outputs_match_autoregressive'] is True
  assert (out / 'serve_load.png').stat().st_size > 0
