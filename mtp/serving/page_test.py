"""The page at `GET /` in a real headless browser (Debian's chromium, driven by Playwright):
a prompt submitted, both decoders streamed side by side, each text equal to the API's
completion, each step's tokens shaded as one run, and a screenshot saved."""

import os
import pathlib

import pytest

import mtp
from benchmarks import serve_page
from mtp.serving import server

MAX_TOKENS = 24
PROMPT = 'def add(a, b):\n    return'
SCREENSHOT = pathlib.Path(os.environ.get('MTP_RESULTS', 'results')) / 'serve_page_test.png'

pytestmark = pytest.mark.skipif(serve_page.chromium() is None,
                                reason='no chromium (.ci/run installs it)')


@pytest.fixture(scope='module')
def served(tiny_workdir):
  loaded = mtp.load(tiny_workdir)
  with server.running(loaded, max_batch=2, max_wait_ms=5,
                      decoders=('autoregressive', 'speculative')) as (url, _):
    yield url


def test_the_page_streams_both_decoders_and_matches_the_api(served):
  shown = serve_page.drive(served, PROMPT, MAX_TOKENS, SCREENSHOT)
  assert set(shown) == {'autoregressive', 'speculative'}
  for decoder, panel in shown.items():
    assert not panel['error'], decoder
    assert panel['completion'] == serve_page.api_completion(served, PROMPT, MAX_TOKENS, decoder)
    assert 1 <= panel['steps'] <= MAX_TOKENS and panel['runs'] <= panel['steps']
  assert shown['autoregressive']['completion'] == shown['speculative']['completion']
  # A step with no visible text draws no run; every token arrived in some step.
  assert shown['autoregressive']['steps'] >= shown['speculative']['steps']
  assert SCREENSHOT.stat().st_size > 10_000
