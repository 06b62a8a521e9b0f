"""benchmarks.draft_vocab end to end on a tiny trained model: both decoders, both prompt kinds."""

import json

import pytest
from absl import flags
from absl.testing import flagsaver

from benchmarks import draft_vocab

FLAGS = flags.FLAGS


@pytest.mark.slow
@flagsaver.flagsaver
def test_auto_over_code_and_prose_is_exact_and_counts_the_vocabulary(tiny_workdir, tmp_path):
  out = tmp_path / 'draft_vocab.json'
  FLAGS.unparse_flags()
  FLAGS(['draft_vocab', f'--workdir={tiny_workdir}', '--decoder=auto', '--kinds=code,prose',
         '--sizes=16,0', '--batch_sizes=1', '--num_prompts=1', '--prompt_tokens=64',
         '--max_new_tokens=6', '--repeats=1', '--step_repeats=1', f'--output={out}'])
  draft_vocab.main(['draft_vocab'])
  result = json.loads(out.read_text())
  vocab_size = result['vocab_size']
  rows = {(r['kind'], r['decoder']): r for r in result['rows']}
  assert set(rows) == {(kind, name) for kind in ('code', 'prose')
                       for name in ('autoregressive', 'N=16', f'N={vocab_size}')}
  for row in rows.values():
    assert row['outputs_match'] is True  # Greedy: every decoder equals autoregressive.
  for kind in ('code', 'prose'):
    whole, small = rows[kind, f'N={vocab_size}'], rows[kind, 'N=16']
    assert whole['reference_tokens_in_vocab'] == 1.0
    assert 0 <= small['reference_tokens_in_vocab'] <= 1.0
    assert small['step_cost'] > 0 and small['draft_vocab'] == 16
