"""config.profile_steps: the setting's grammar, and a tiny run that writes a trace (and logs its
TFLOP/s) into the workdir."""

import pytest

from mtp.train import profiling
from mtp.train import testing
from mtp.train import trainer as trainer_lib
from mtp.train import writers


@pytest.mark.parametrize('spec, steps', [
    ('', None), ('  ', None), ('5', (5, 7)), ('2:3', (2, 3)), (' 4 : 4 ', (4, 4))])
def test_profile_steps_grammar(spec, steps):
  assert profiling.parse_profile_steps(spec) == steps


@pytest.mark.parametrize('spec', ['x', '3:', ':3', '0', '5:4', '1,2', '-1'])
def test_bad_profile_steps_are_named(spec):
  with pytest.raises(profiling.ProfileStepsError, match='profile_steps'):
    profiling.parse_profile_steps(spec)


def test_a_bad_profile_steps_fails_before_anything_runs(tmp_path):
  config = testing.tiny_config(profile_steps='later')
  with pytest.raises(profiling.ProfileStepsError):
    trainer_lib.train_and_evaluate(config, tmp_path)
  assert not (tmp_path / 'config.json').exists()


def test_a_run_writes_the_trace_of_its_profiled_steps_and_logs_tflops(tmp_path):
  config = testing.tiny_config(num_train_steps=3, log_every_steps=1, eval_steps=0,
                               checkpoint_every_steps=3, profile_steps='2:3')
  trainer_lib.train_and_evaluate(config, tmp_path)
  traces = list((tmp_path / 'profile').glob('plugins/profile/*/*.xplane.pb'))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  records = [r for r in writers.read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in records] == [1, 2, 3]
  assert all(r['tflops_per_sec_per_device'] > 0 for r in records[1:])
  assert not any('mfu' in r for r in records)  # CPU: no known peak.
