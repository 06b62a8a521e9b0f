"""benchmarks.data_scale: a run's checkpoints decoded against the tokens they trained on."""

import json

import pytest
from absl import flags
from absl.testing import flagsaver

from benchmarks import data_scale

FLAGS = flags.FLAGS


def test_workdirs_are_named_by_their_flag_or_their_directory():
  runs = data_scale.parse_workdirs(['hard=w/a', 'w/b'])
  assert {name: str(path) for name, path in runs.items()} == {'hard': 'w/a', 'b': 'w/b'}
  with pytest.raises(ValueError, match="names 'a' twice"):
    data_scale.parse_workdirs(['w/a', 'a=w/c'])


@flagsaver.flagsaver
def test_every_kept_checkpoint_is_decoded_exactly(tiny_workdir, tmp_path):
  FLAGS.unparse_flags()
  FLAGS(['data_scale', f'--workdirs=tiny={tiny_workdir}', '--kinds=code', '--num_prompts=2',
         '--prompt_tokens=32', '--max_new_tokens=6', f'--output={tmp_path / "out.json"}',
         '--plot='])
  data_scale.main([])
  rows = json.loads((tmp_path / 'out.json').read_text())['rows']
  config = json.loads((tiny_workdir / 'config.json').read_text())
  assert [r['step'] for r in rows] == [config['num_train_steps']]
  [row] = rows
  assert row['exact'] and row['tokens'] == 2 * 6 - 2  # The prefill gives each first token.
  assert row['train_tokens'] == (config['num_train_steps'] * config['data']['batch_size']
                                 * config['data']['seq_len'])
  assert 1.0 <= row['tokens_per_step'] <= 1 + config['model']['mtp_num_heads']
  accepted = row['accepted_at_depth']
  assert len(accepted) == config['model']['mtp_num_heads']
  assert row['tokens_per_step'] == pytest.approx(1 + sum(accepted))  # Depth by depth.
  # Another run's rows and this run's other steps stay; this step is measured again.
  other, earlier = dict(row, run='other'), dict(row, step=row['step'] - 1)
  (tmp_path / 'out.json').write_text(json.dumps({'rows': [other, earlier,
                                                          dict(row, tokens=-1)]}))
  data_scale.main([])
  rows = json.loads((tmp_path / 'out.json').read_text())['rows']
  assert rows == [other, earlier, row]
  with pytest.raises(ValueError, match='not \\[1000\\]'):
    FLAGS.steps = ['1000']
    data_scale.main([])
