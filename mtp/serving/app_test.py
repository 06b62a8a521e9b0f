"""The server end to end on localhost: the official openai client, streamed and not, and raw
HTTP for errors, faults, a full queue, a client leaving mid-stream, the metrics, and requests
with their own settings (temperature, top_p, top_k, max_tokens, seed, n, logprobs) sharing
batches without a compilation."""

import concurrent.futures
import json
import random
import threading
import time

import httpx2 as httpx
import numpy as np
import openai
from prometheus_client import parser as prometheus_parser
import pytest

import mtp
from mtp.decode import engine
from mtp.serving import server
from mtp.serving import testing

MAX_TOKENS = 8
PROMPTS = ['def f(x):', 'import os\n', 'class A:', 'x = [1, 2', 'for i in range(']
# The default decoder (auto) and the one whose batches are bit-exact against launch.generate.
DECODERS = ('auto', 'speculative')


@pytest.fixture(scope='module')
def served(tiny_workdir):
  loaded = mtp.load(tiny_workdir)
  with server.running(loaded, max_batch=4, max_wait_ms=20, decoders=DECODERS) as (url, batcher):
    assert batcher.warm.wait(300) and batcher.startup_error is None
    yield url, batcher, loaded


@pytest.fixture(scope='module')
def client(served):
  return openai.OpenAI(base_url=served[0] + '/v1', api_key='unused', max_retries=0)


def test_health_models_and_placeholder_page(served):
  url = served[0]
  health = httpx.get(url + '/health').json()
  assert health['status'] == 'ok'
  models = httpx.get(url + '/v1/models').json()
  assert [m['id'] for m in models['data']] == ['mtp']
  assert models['data'][0]['mtp']['decoders'] == list(DECODERS)
  assert models['data'][0]['mtp']['default_decoder'] == 'auto'
  assert len(health['compiled']) == len(DECODERS)
  page = httpx.get(url + '/')
  assert page.status_code == 200 and 'text/html' in page.headers['content-type']


@pytest.mark.parametrize('decoder', DECODERS)
def test_greedy_completions_equal_launch_generate_in_a_mixed_batch(served, client, decoder):
  """Bit for bit under speculative; under auto up to float ties where the server's batch ran
  other kinds of step than a batch of one (none on this model)."""
  url, batcher, loaded = served
  want = testing.references(loaded, PROMPTS, MAX_TOKENS, decoder=decoder)
  got, errors = {}, []

  def ask(prompt, stream):
    try:
      if stream:
        text, tokens = '', []
        for chunk in client.completions.create(model='anything', prompt=prompt,
                                               max_tokens=MAX_TOKENS, stream=True,
                                               extra_body={'decoder': decoder}):
          text += chunk.choices[0].text if chunk.choices else ''
          if chunk.model_extra['mtp'].get('step') is not None:
            tokens += chunk.model_extra['mtp']['tokens']
      else:
        response = client.completions.create(model='anything', prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={'decoder': decoder})
        text, tokens = response.choices[0].text, response.model_extra['mtp']['tokens']
      got[prompt, stream] = text, tokens
    except Exception as e:  # noqa: BLE001
      errors.append(e)
  # Streamed and plain requests of different prompts arrive together: they share batches.
  threads = [threading.Thread(target=ask, args=(p, s)) for p in PROMPTS for s in (False, True)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  for (prompt, _), (text, tokens) in got.items():
    assert tokens == want[prompt], prompt
    assert text == loaded.tokenizer.decode(want[prompt])


def test_stream_chunks_carry_steps_and_usage(client):
  chunks = list(client.completions.create(model='m', prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                          stream=True))
  steps = [c.model_extra['mtp'] for c in chunks if 'step' in c.model_extra['mtp']]
  assert [s['step'] for s in steps] == list(range(len(steps)))  # One chunk per step.
  assert all(s['accepted'] == len(s['tokens']) >= 1 for s in steps)
  final = chunks[-1]
  assert final.choices[0].finish_reason in ('stop', 'length')
  assert final.usage.completion_tokens == sum(s['accepted'] for s in steps)
  assert final.usage.model_extra['tokens_per_step'] >= 1


def test_chat_completion_uses_the_template(served, client):
  loaded = served[2]
  messages = [{'role': 'user', 'content': 'hi'}]
  response = client.chat.completions.create(model='m', messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0)
  want = testing.references(loaded, ['user: hi\nassistant:'], MAX_TOKENS)['user: hi\nassistant:']
  assert response.model_extra['mtp']['tokens'] == want
  assert response.choices[0].message.content == loaded.tokenizer.decode(want)
  text = ''.join(c.choices[0].delta.content or '' for c in client.chat.completions.create(
      model='m', messages=messages, max_tokens=MAX_TOKENS, stream=True) if c.choices)
  assert text == response.choices[0].message.content


@pytest.mark.parametrize('body, fragment, param', [
    (b'{not json', 'not valid JSON', None),
    (b'[1, 2]', 'JSON object', None),
    (json.dumps({'prompt': ''}).encode(), 'empty', 'prompt'),
    (json.dumps({'prompt': 'x', 'max_tokens': 0}).encode(), 'max_tokens', 'max_tokens'),
    (json.dumps({'prompt': 'x', 'max_tokens': '8'}).encode(), 'integer', 'max_tokens'),
    (json.dumps({'prompt': 'x', 'temperature': 'hot'}).encode(), 'number', 'temperature'),
    (json.dumps({'prompt': 7}).encode(), 'prompt', 'prompt'),
    (json.dumps({'prompt': 'x', 'stream': 'yes'}).encode(), 'boolean', 'stream'),
    (json.dumps({'prompt': 'x', 'n': 5}).encode(), 'n must be at most 4', 'n'),
    (json.dumps({'prompt': 'x', 'stop': 3}).encode(), 'stop', 'stop'),
    (json.dumps({'prompt': 'x' * 300, 'max_tokens': 8}).encode(), 'no room', 'prompt'),
    (json.dumps({'prompt': 'x' * 200, 'max_tokens': 100}).encode(), 'max_tokens 100 exceeds',
     'max_tokens'),
    (json.dumps({'prompt': 'x', 'decoder': 'magic'}).encode(), 'decoder', 'decoder'),
    (json.dumps({'prompt': 'x', 'temperature': -0.1}).encode(), 'temperature must be in',
     'temperature'),
    (b'{"prompt": "x", "temperature": NaN}', 'temperature must be in', 'temperature'),
    (json.dumps({'prompt': 'x', 'top_p': 0}).encode(), 'top_p must be in (0', 'top_p'),
    (json.dumps({'prompt': 'x', 'top_p': 1.5}).encode(), 'top_p must be in (0', 'top_p'),
    (json.dumps({'prompt': 'x', 'top_k': -1}).encode(), 'top_k must be >= 0', 'top_k'),
    (json.dumps({'prompt': 'x', 'top_k': 10_000}).encode(), 'top_k must be <= the vocabulary',
     'top_k'),
    (json.dumps({'prompt': 'x', 'logprobs': 21}).encode(), 'logprobs must be <= 20', 'logprobs'),
    (json.dumps({'prompt': 'x', 'presence_penalty': 0.5}).encode(), 'presence_penalty is not',
     'presence_penalty'),
    (json.dumps({'prompt': 'x', 'frequency_penalty': 1}).encode(), 'frequency_penalty is not',
     'frequency_penalty'),
    (json.dumps({'prompt': 'x', 'logit_bias': {'5': 1}}).encode(), 'logit_bias is not',
     'logit_bias'),
    (json.dumps({'prompt': 'x', 'seed': 'a'}).encode(), 'seed must be an integer', 'seed'),
    (json.dumps({'prompt': 'x', 'max_tokens': 2 ** 63}).encode(), 'max_tokens', 'max_tokens'),
    (json.dumps({'prompt': '\ud800'}).encode(), 'not valid Unicode', 'prompt'),
    (b'{"prompt": "x", "seed": ' + b'9' * 5000 + b'}', 'cannot be read', None),
    (b'[' * 100_000 + b']' * 100_000, 'cannot be read', None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, body, fragment,
                                                                     param):
  url = served[0]
  response = httpx.post(url + '/v1/completions', content=body,
                        headers={'content-type': 'application/json'})
  assert response.status_code == 400, response.text
  error = response.json()['error']
  assert fragment in error['message'] and error['type'] == 'invalid_request_error'
  assert error['param'] == param  # The field is named.
  ok = httpx.post(url + '/v1/completions', json={'prompt': 'x', 'max_tokens': MAX_TOKENS})
  assert ok.status_code == 200


def test_chat_without_messages_is_refused(served):
  response = httpx.post(served[0] + '/v1/chat/completions', json={'messages': []})
  assert response.status_code == 400 and 'messages' in response.json()['error']['message']


def test_a_failing_batch_fails_its_requests_only(served, client):
  url, batcher, _ = served

  def fault(jobs):
    if any(j.prompt.startswith('FAULT') for j in jobs):
      raise RuntimeError('injected')
  batcher.fault = fault
  try:
    bad = httpx.post(url + '/v1/completions', json={'prompt': 'FAULT', 'max_tokens': MAX_TOKENS})
    assert bad.status_code == 500
    assert 'injected' in bad.json()['error']['message']
    assert bad.json()['error']['type'] == 'server_error'
  finally:
    batcher.fault = None
  again = client.completions.create(model='m', prompt='FAULT', max_tokens=MAX_TOKENS)
  assert again.choices[0].finish_reason in ('stop', 'length')


def test_a_full_queue_answers_503(served):
  url, batcher, _ = served
  limit, batcher.max_queue = batcher.max_queue, 0
  try:
    response = httpx.post(url + '/v1/completions', json={'prompt': 'x'})
  finally:
    batcher.max_queue = limit
  assert response.status_code == 503
  assert response.json()['error']['code'] == 'queue_full'


def test_a_client_leaving_mid_stream_frees_its_row(served):
  url, batcher, _ = served
  chunks_seen = []

  def slow(jobs):  # Each chunk of a SLOW request takes a while: the client leaves meanwhile.
    if any(j.prompt.startswith('SLOW') for j in jobs):
      chunks_seen.append(1)
      time.sleep(0.3)
  batcher.fault = slow
  try:
    with httpx.stream('POST', url + '/v1/completions',
                      json={'prompt': 'SLOW', 'max_tokens': MAX_TOKENS, 'stream': True}) as r:
      first = next(r.iter_lines())
      assert first.startswith('data: ')
    deadline = time.monotonic() + 10
    while batcher.active_rows and time.monotonic() < deadline:
      time.sleep(0.05)
    assert batcher.active_rows == 0
    assert len(chunks_seen) < MAX_TOKENS  # It stopped before decoding every token.
  finally:
    batcher.fault = None
  metrics = httpx.get(url + '/metrics').text
  assert 'mtp_cancelled_total 1.0\n' in metrics


def test_metrics_are_prometheus_text(served):
  # Its own request: under pytest-xdist this test may run before (or without) the others.
  ok = httpx.post(served[0] + '/v1/completions', json={'prompt': 'x', 'max_tokens': 2},
                  timeout=60)
  assert ok.status_code == 200
  text = httpx.get(served[0] + '/metrics').text
  samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for family in prometheus_parser.text_string_to_metric_families(text)
             for s in family.samples}
  assert samples[('mtp_requests_total', (('code', '200'), ('endpoint', '/v1/completions')))] >= 1
  assert samples[('mtp_request_latency_seconds_bucket', (('le', '+Inf'),))] >= 1
  for name in ('mtp_request_errors_total', 'mtp_queue_depth', 'mtp_completion_tokens_total',
               'mtp_tokens_per_step', 'mtp_time_to_first_token_seconds_count',
               'mtp_compilations_total'):
    assert (name, ()) in samples, name


def test_a_request_joins_a_running_batch(served, client):
  url, batcher, loaded = served
  want = testing.references(loaded, [PROMPTS[1]], MAX_TOKENS, decoder='auto')[PROMPTS[1]]
  seen = []

  def slow(jobs):  # Every chunk of a batch holding a SLOW request takes a while.
    if any(j.prompt.startswith('SLOW') for j in jobs):
      seen.append((len(jobs), sum(bool(lane.live) for lane in batcher._lanes.values())))
      time.sleep(0.15)
  batcher.fault = slow
  try:
    with httpx.stream('POST', url + '/v1/completions', timeout=30,
                      json={'prompt': 'SLOW', 'max_tokens': MAX_TOKENS, 'stream': True}) as r:
      lines = r.iter_lines()
      next(lines)  # The slow row is decoding now.
      response = client.completions.create(model='m', prompt=PROMPTS[1],
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={'decoder': 'auto'})
      assert [line for line in lines if line][-1] == 'data: [DONE]'
  finally:
    batcher.fault = None
  assert response.model_extra['mtp']['tokens'] == want
  assert (2, 1) in seen  # Both rows in one running batch: the second joined the first.
  assert all(active <= 1 for _, active in seen)  # No other batch ran beside it.


def test_stop_sequences_cut_the_text_streamed_or_not(served, client):
  loaded = served[2]
  tokens = testing.references(loaded, [PROMPTS[0]], MAX_TOKENS)[PROMPTS[0]]
  full = loaded.tokenizer.decode(tokens)
  stop = full[2:4]
  assert stop and len(full) > 4
  response = client.completions.create(model='m', prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0, stop=[stop])
  assert response.choices[0].text == full[:full.index(stop)]
  assert response.choices[0].finish_reason == 'stop'
  streamed = ''.join(c.choices[0].text for c in client.completions.create(
      model='m', prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=stop, stream=True) if c.choices)
  assert streamed == response.choices[0].text


def test_sampled_requests_are_served(client):
  response = client.completions.create(model='m', prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                        temperature=0.8, top_p=0.9, seed=3)
  assert 1 <= response.usage.completion_tokens <= MAX_TOKENS
  assert response.choices[0].finish_reason in ('stop', 'length')


def _metric(url: str, name: str) -> float:
  text = httpx.get(url + '/metrics').text
  return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + ' ')))


def test_requests_with_any_settings_share_batches_and_compile_nothing(served):
  """40 concurrent requests, each with its own temperature, top_p, top_k, max_tokens, seed and
  decoder: all served, and the compilation counter does not move."""
  url = served[0]
  before = _metric(url, 'mtp_compilations_total')
  assert before == engine.compilations() > 0
  draw = random.Random(1)
  bodies = [{'prompt': draw.choice(PROMPTS), 'max_tokens': draw.randint(1, 40),
             'temperature': draw.choice([0, 0.3, 0.7, 1.0]), 'top_p': draw.choice([0.9, 1]),
             'top_k': draw.choice([0, 5]), 'seed': draw.randint(0, 2 ** 40),
             'decoder': draw.choice(DECODERS), 'stream': draw.random() < 0.3}
            for _ in range(40)]

  def ask(body):
    return httpx.post(url + '/v1/completions', json=body, timeout=120)
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    responses = list(pool.map(ask, bodies))
  assert [r.status_code for r in responses] == [200] * len(bodies)
  for body, response in zip(bodies, responses):
    if not body['stream']:
      assert 1 <= response.json()['usage']['completion_tokens'] <= body['max_tokens']
  assert _metric(url, 'mtp_compilations_total') == before


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_others(served, client):
  url = served[0]
  body = dict(model='m', prompt=PROMPTS[2], max_tokens=24, temperature=0.8, seed=1234)
  alone = client.completions.create(**body).model_extra['mtp']['tokens']
  again = client.completions.create(**body).model_extra['mtp']['tokens']
  assert alone == again

  def neighbour(i):
    return httpx.post(url + '/v1/completions', timeout=120, json={
        'prompt': PROMPTS[i % len(PROMPTS)], 'max_tokens': 5 + i % 20,
        'temperature': 0.3 * (i % 4), 'seed': i})
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    crowd = [pool.submit(neighbour, i) for i in range(7)]
    among = client.completions.create(**body).model_extra['mtp']['tokens']
    assert all(f.result().status_code == 200 for f in crowd)
  assert among == alone
  other = client.completions.create(**dict(body, seed=4321)).model_extra['mtp']['tokens']
  assert other != alone


def test_n_completions_are_rows_of_one_request(served, client):
  greedy = client.completions.create(model='m', prompt=PROMPTS[0], max_tokens=6, n=3,
                                     temperature=0)
  assert [c.index for c in greedy.choices] == [0, 1, 2]
  assert len({c.text for c in greedy.choices}) == 1  # Greedy rows agree.
  sampled = client.completions.create(model='m', prompt=PROMPTS[0], max_tokens=12, n=3,
                                      temperature=1.0, seed=7)
  texts = [c.text for c in sampled.choices]
  assert len(set(texts)) > 1  # Each choice samples with its own key.
  assert texts == [c.text for c in client.completions.create(
      model='m', prompt=PROMPTS[0], max_tokens=12, n=3, temperature=1.0, seed=7).choices]
  assert sampled.usage.completion_tokens == sum(
      len(t) for t in sampled.model_extra['mtp']['choices_tokens'])
  streamed = {}
  for chunk in client.completions.create(model='m', prompt=PROMPTS[0], max_tokens=12, n=3,
                                         temperature=1.0, seed=7, stream=True):
    for choice in chunk.choices:
      streamed[choice.index] = streamed.get(choice.index, '') + choice.text
  assert [streamed[i] for i in range(3)] == texts


def test_logprobs_are_the_models_on_both_endpoints(served, client):
  loaded = served[2]
  [want] = mtp.generate(loaded, PROMPTS[1], max_new_tokens=6, decoder='autoregressive',
                        logprobs=2)
  response = client.completions.create(model='m', prompt=PROMPTS[1], max_tokens=6,
                                        temperature=0, logprobs=2,
                                        extra_body={'decoder': 'speculative'})
  got = response.choices[0].logprobs
  assert got.tokens == [loaded.tokenizer.decode([t]) for t in want.tokens]
  np.testing.assert_allclose(got.token_logprobs, want.logprobs, atol=1e-4)
  assert all(len(top) <= 2 for top in got.top_logprobs)
  assert got.text_offset[0] == 0
  chat = client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'hi'}],
                                        max_tokens=4, logprobs=True, top_logprobs=3)
  content = chat.choices[0].logprobs.content
  assert len(content) >= 1 and all(len(entry.top_logprobs) == 3 for entry in content)
  assert all(entry.logprob <= 0 for entry in content)
  assert client.completions.create(model='m', prompt='x', max_tokens=2).choices[0].logprobs is None
