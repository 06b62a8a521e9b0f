"""benchmarks/device.sh --tiny: the accelerator script's every step, on CPU and tiny models,
without the packages the GPU machine's image lacks."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks import device
from benchmarks.device_imports_test import blocking_env
from mtp import testing as mtp_testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_run_writes_every_figure(tiny_workdir, tmp_path):
  demo = tiny_workdir
  env = blocking_env(tmp_path / 'site', mtp_testing.child_env(
      PYTHON=sys.executable, RESULTS=str(tmp_path / 'results'), OUT=str(tmp_path),
      JAX_PLATFORMS='cpu'))
  run = subprocess.run(
      ['bash', 'benchmarks/device.sh', '--tiny', '--batch_sizes=2', '--token_counts=1,4',
       '--max_new_tokens=8', f'--demo_workdir={demo}', '--demo_auto', '--time_budget=0'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
  report = json.loads((tmp_path / 'device.json').read_text())
  assert report['tiny'] and report['device'].startswith('cpu')
  random_model = report['random_smollm2_shape']
  relative = random_model['cost']['2']['relative']
  assert sorted(relative, key=int) == ['1', '4'] and relative['1'] == 1.0
  decoders = [r['decoder'] for r in random_model['decoding']]
  assert decoders == ['autoregressive', 'heads chain 4 (random heads)', 'oracle chain 4']
  oracle = [r for r in random_model['decoding'] if r['decoder'] == 'oracle chain 4']
  # Oracle drafts are all accepted: 8 tokens = the prefill's + 7 in two steps of up to 5.
  assert all(r['tokens_per_step'] == 3.5 for r in oracle), oracle
  demo_rows = report['demo']['decoding']
  assert [r['decoder'].split(' ')[0] for r in demo_rows] == [
      'autoregressive', 'heads', 'auto', 'default', 'chain'], demo_rows
  assert all(r['tokens_per_sec'] > 0 for r in demo_rows)
  assert all(r['outputs_match'] for r in demo_rows)  # float32: exact.
  assert 'all outputs exact' in run.stdout
  steps = report['steps']
  assert [s['status'] for s in steps] == ['done'] * 3, steps
  assert [s['name'].split(':')[0] for s in steps] == [
      'cost curve, SmolLM2 shape, batch 2, T = 1,4', 'decoding, SmolLM2 shape, batch 2',
      'decoding, demo model, batch 2']
  assert '[1/3] cost curve, SmolLM2 shape, batch 2, T = 1,4: budget 30 s' in run.stdout
  assert 'all outputs exact' in (tmp_path / 'device.log').read_text()


def test_steps_skip_what_does_not_fit_and_keep_what_ran(tmp_path, capsys):
  report = {'demo': {'decoding': []}}
  path = tmp_path / 'device.json'
  steps = device.Steps(report, path, time_budget=100, start=time.perf_counter())
  row = dict(outputs_match=True, speedup=2.0)

  def measure():
    report['demo']['decoding'].append(row)
    steps.save()  # A measurement is on disk before the step ends.
    assert json.loads(path.read_text())['demo']['decoding'] == report['demo']['decoding']

  def fail():
    raise RuntimeError('out of memory')

  steps.run_all([('one', 10, measure), ('too long', 1000, measure), ('broken', 10, fail),
                 ('two', 10, measure)])
  saved = json.loads(path.read_text())
  assert [(s['name'], s['status']) for s in saved['steps']] == [
      ('one', 'done'), ('too long', 'skipped'), ('broken', 'failed'), ('two', 'done')]
  assert saved['steps'][2]['error'] == 'RuntimeError: out of memory' and steps.failed
  assert saved['demo']['decoding'] == [row, row] and saved['median_speedup'] == 2.0
  assert saved['time_budget'] == 100 and saved['all_exact']
  out = capsys.readouterr().out
  assert '[2/4] too long: budget 1000 s' in out and '[2/4] skipped' in out
  assert not list(tmp_path.glob('*.partial'))


@pytest.mark.parametrize('budget', [0, None])
def test_steps_without_a_time_budget_run_everything(tmp_path, budget):
  steps = device.Steps({}, tmp_path / 'device.json', time_budget=budget,
                       start=time.perf_counter())
  steps.run_all([('long', 1e9, lambda: None)])
  assert steps.report['steps'][0]['status'] == 'done' and not steps.failed
