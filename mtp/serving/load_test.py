"""Load: 32 concurrent clients, a few hundred greedy requests, no errors, every output exact."""

import concurrent.futures
import random

import openai
import pytest

import mtp
from mtp.serving import server
from mtp.serving import testing

MAX_TOKENS = 6
CLIENTS = 32
REQUESTS = 256
# Short prompts of many lengths (one compiled program serves them all).
PROMPTS = [f'def f{i}(x):\n  return x' + ' +' * (i % 5) for i in range(24)]


@pytest.fixture(scope='module')
def served(tiny_workdir):
  loaded = mtp.load(tiny_workdir)
  with server.running(loaded, max_batch=8, max_wait_ms=5, max_queue=REQUESTS,
                      decoders=('speculative',)) as (url, batcher):
    yield url, batcher, loaded


def test_32_concurrent_clients_hundreds_of_requests_all_exact(served):
  url, batcher, loaded = served
  want = testing.references(loaded, PROMPTS, MAX_TOKENS)
  clients = [openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
             for _ in range(CLIENTS)]
  order = random.Random(0)
  jobs = [(i, order.choice(PROMPTS), i % 3 == 0) for i in range(REQUESTS)]

  def ask(job):
    i, prompt, stream = job
    client = clients[i % CLIENTS]
    if stream:
      tokens, text = [], ''
      for chunk in client.completions.create(model='m', prompt=prompt, max_tokens=MAX_TOKENS,
                                             stream=True):
        text += chunk.choices[0].text if chunk.choices else ''
        if 'step' in chunk.model_extra['mtp']:
          tokens += chunk.model_extra['mtp']['tokens']
      return prompt, tokens, text
    response = client.completions.create(model='m', prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0)
    return prompt, response.model_extra['mtp']['tokens'], response.choices[0].text

  with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
    results = list(pool.map(ask, jobs))
  wrong = [p for p, tokens, text in results
           if tokens != want[p] or text != loaded.tokenizer.decode(want[p])]
  assert len(results) == REQUESTS and not wrong
  import httpx2 as httpx
  metrics = httpx.get(url + '/metrics').text
  assert 'mtp_request_errors_total 0.0\n' in metrics
  batches = float(next(l.split()[1] for l in metrics.splitlines()
                       if l.startswith('mtp_batches_total')))
  assert batches < REQUESTS  # Requests did share batches.
