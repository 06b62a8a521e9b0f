"""launch.serve as a user runs it: a subprocess on a free port, healthy within two minutes, and
its greedy completion equal to `python -m launch.generate`'s on the same workdir."""

import json
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest

from mtp import testing as mtp_testing
from mtp.serving import server

PROMPT = 'def add(a, b):\n'


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  return tiny_workdir


def _env():
  return mtp_testing.child_env(JAX_PLATFORMS='cpu')


def test_serve_answers_health_soon_and_matches_launch_generate(workdir):
  sock = server.free_socket()
  port = sock.getsockname()[1]
  sock.close()
  start = time.monotonic()
  serve = subprocess.Popen(
      [sys.executable, '-m', 'launch.serve', f'--workdir={workdir}', f'--port={port}',
       '--decoders=auto', '--model_name=tiny'],
      env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    # launch.generate runs meanwhile (the reference), as a user would run it.
    generated = subprocess.run(
        [sys.executable, '-m', 'launch.generate', f'--workdir={workdir}', f'--prompt={PROMPT}',
         '--max_new_tokens=8'], env=_env(), capture_output=True, text=True, check=True)
    want = json.loads(generated.stdout.splitlines()[-1])
    url = f'http://127.0.0.1:{port}'
    while True:
      assert serve.poll() is None, serve.stdout.read()
      try:
        if httpx.get(url + '/health', timeout=1).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() - start < 120, 'no /health within 2 minutes'
      time.sleep(0.2)
    client = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    assert [m.id for m in client.models.list()] == ['tiny']
    response = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=8,
                                          temperature=0)
    assert response.choices[0].text == want['completion']
    assert response.model_extra['mtp']['tokens'] == want['tokens']
    assert response.usage.completion_tokens == len(want['tokens'])
  finally:
    serve.terminate()
    serve.wait(timeout=30)


def test_bad_flag_is_one_line_and_exit_code_2(workdir):
  run = subprocess.run([sys.executable, '-m', 'launch.serve', f'--workdir={workdir}',
                        '--max_batch=many'], env=_env(), capture_output=True, text=True)
  assert run.returncode == 2
  assert run.stderr.strip().startswith('launch.serve:')


@pytest.mark.parametrize('flag', ['--max_request_bytes=0', '--request_timeout_s=0',
                                  '--max_connections=0'])
def test_a_bad_limit_is_named_in_one_line_before_loading(workdir, flag):
  run = subprocess.run([sys.executable, '-m', 'launch.serve', f'--workdir={workdir}', flag],
                       env=_env(), capture_output=True, text=True, timeout=120)
  assert run.returncode == 1
  line = run.stderr.strip().splitlines()[-1]
  assert line.startswith('launch.serve:') and flag.split('=')[0] in line
  assert 'Traceback' not in run.stderr


def test_a_jax_export_artifact_is_refused_by_name(workdir, tmp_path):
  from mtp.export import writer
  artifact = tmp_path / 'artifact'
  writer.export(workdir, 'jax_export', artifact, max_new_tokens=4)
  run = subprocess.run([sys.executable, '-m', 'launch.serve', f'--workdir={artifact}'],
                       env=_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode == 1
  assert 'jax_export artifact' in run.stderr and 'Traceback' not in run.stderr
