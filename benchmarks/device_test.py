"""benchmarks/device.sh --tiny: the accelerator script's every step, on CPU and tiny models."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_run_writes_every_figure(tiny_workdir, tmp_path):
  demo = tiny_workdir
  env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path / 'results'),
             OUT=str(tmp_path), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  run = subprocess.run(
      ['bash', 'benchmarks/device.sh', '--tiny', '--batch_sizes=2', '--token_counts=1,4',
       '--max_new_tokens=8', f'--demo_workdir={demo}'],
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
  assert len(demo_rows) == 4 and all(r['tokens_per_sec'] > 0 for r in demo_rows)
  assert all(r['outputs_match'] for r in demo_rows)  # float32: exact.
  assert 'all outputs exact' in run.stdout
