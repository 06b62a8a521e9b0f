r"""The server's page (`GET /`) in a real headless browser: a prompt submitted, every decoder
streamed side by side, the page's text checked against the API's, and a screenshot saved.

  python -m benchmarks.serve_page --workdir=workdirs/code_small --output=docs/serve_page.png

Chromium is Debian's (`apt-get install chromium`; `.ci/run` installs it), driven by Playwright
without a browser download of its own.
"""

from __future__ import annotations

import pathlib
import shutil

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Trained workdir to serve.')
flags.DEFINE_string('prompt', 'import os\n\n\ndef read_lines(path):\n', 'The prompt typed in.')
flags.DEFINE_integer('max_tokens', 64, 'max tokens set on the page.')
flags.DEFINE_string('output', 'results/serve_page.png', 'Where the screenshot goes.')

# Chromium's background services try Google's hosts; this machine's network is closed.
CHROMIUM_ARGS = ('--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                 '--disable-background-networking', '--disable-component-update',
                 '--disable-sync')


def chromium() -> str | None:
  return shutil.which('chromium') or shutil.which('chromium-browser')


def drive(url: str, prompt: str, max_tokens: int, screenshot: pathlib.Path) -> dict:
  """Submits `prompt` on the page at `url` and waits for every decoder's stream to end.

  Returns:
    decoder -> {'completion': the page's text, 'runs': shaded step runs, 'steps': the page's
    step count, 'error': whether the panel shows an error}.
  """
  from playwright.sync_api import sync_playwright
  with sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path=chromium(), args=list(CHROMIUM_ARGS))
    try:
      page = browser.new_page(viewport={'width': 1280, 'height': 800})
      page.goto(url + '/')
      page.wait_for_selector('input.decoder')
      page.fill('#prompt', prompt)
      page.fill('#max_tokens', str(max_tokens))
      page.click('#run')
      page.wait_for_function("document.body.dataset.done === 'true'", timeout=300_000)
      shown = {}
      for panel in page.query_selector_all('section.panel'):
        shown[panel.get_attribute('data-decoder')] = {
            'completion': panel.get_attribute('data-completion'),
            'runs': len(panel.query_selector_all('.run')),
            'steps': int(panel.query_selector('.nstep').inner_text()),
            'error': panel.query_selector('.state.error') is not None}
      screenshot.parent.mkdir(parents=True, exist_ok=True)
      page.screenshot(path=str(screenshot), full_page=True)
    finally:
      browser.close()
  return shown


def api_completion(url: str, prompt: str, max_tokens: int, decoder: str) -> str:
  """The same request through the API (greedy, not streamed)."""
  import httpx2 as httpx
  body = {'model': 'mtp', 'prompt': prompt, 'max_tokens': max_tokens, 'temperature': 0,
          'decoder': decoder}
  response = httpx.post(url + '/v1/completions', json=body, timeout=300)
  response.raise_for_status()
  return response.json()['choices'][0]['text']


def main(argv):
  del argv
  import launch
  import mtp
  from mtp.serving import server
  launch.quiet_library_logs()
  if chromium() is None:
    raise SystemExit('serve_page: no chromium on PATH (apt-get install chromium)')
  loaded = mtp.load(FLAGS.workdir)
  with server.running(loaded, max_batch=1) as (url, batcher):  # Every decoder, compiled first.
    batcher.warm.wait()
    shown = drive(url, FLAGS.prompt, FLAGS.max_tokens, pathlib.Path(FLAGS.output))
    for decoder, panel in shown.items():
      same = panel['completion'] == api_completion(url, FLAGS.prompt, FLAGS.max_tokens, decoder)
      print(f'{decoder:15s} {panel["steps"]:4d} steps  page text equals the API\'s: {same}')
  print(f'screenshot: {FLAGS.output}')


if __name__ == '__main__':
  flags.mark_flag_as_required('workdir')
  app.run(main)
