"""benchmarks.serve_load in its tiny mode: a 2-step model, few short requests per level, both
kinds of clients."""

import json

from absl import flags
from absl.testing import flagsaver

from benchmarks import serve_load

FLAGS = flags.FLAGS


@flagsaver.flagsaver
def test_tiny_run_writes_figures_and_a_plot_and_compiles_nothing_after_warm_up(
    tiny_workdir, tmp_path):
  out = tmp_path / 'results'
  FLAGS.unparse_flags()
  FLAGS(['serve_load', f'--workdir={tiny_workdir}', '--concurrency=1,8', '--requests=12',
         '--num_prompts=4', '--prompt_tokens=24', '--max_tokens=6', '--mixed_min_tokens=2',
         '--mixed_max_tokens=10', f'--output={out}/serve_load.json',
         f'--plot={out}/serve_load.png'])
  serve_load.main(['serve_load'])
  result = json.loads((out / 'serve_load.json').read_text())
  rows = {(r['concurrency'], r['settings'], r['decoder']): r for r in result['rows']}
  assert set(rows) == {(c, k, d) for c in (1, 8) for k in serve_load.SETTINGS
                       for d in ('auto', 'speculative', 'autoregressive')}
  for row in rows.values():
    assert row['errors'] == 0 and row['tokens_per_sec'] > 0
    assert row['p99_latency_s'] >= row['p50_latency_s'] > 0
    assert row['compilations'] == 0
  assert result['compilations_at_end'] == result['compilations_after_warmup'] > 0
  for c, decoder in ((1, 'speculative'), (8, 'speculative'), (8, 'auto')):
    identical = rows[c, 'identical', decoder]
    assert identical['outputs_match_autoregressive'] is True
    assert identical['greedy_requests'] == 12
    mixed = rows[c, 'mixed', decoder]
    assert mixed['outputs_match_autoregressive'] is True  # Its greedy requests.
    assert 0 < mixed['greedy_requests'] < 12
    # Mixed budgets: the requests' lengths differ (the tiny model rarely stops early).
    assert len(set(mixed['outputs'].values())) > 1
  assert (out / 'serve_load.png').stat().st_size > 0
