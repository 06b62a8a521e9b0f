"""The server end to end on localhost: the official openai client, streamed and not, and raw
HTTP for errors, faults, a full queue, a client leaving mid-stream, and the metrics."""

import json
import threading
import time

import httpx2 as httpx
import openai
import pytest

import mtp
from mtp.serving import server
from mtp.serving import testing

MAX_TOKENS = 8  # One compiled shape for every request here: short prompts, max_tokens 8.
PROMPTS = ['def f(x):', 'import os\n', 'class A:', 'x = [1, 2', 'for i in range(']


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  workdir = testing.tiny_workdir(tmp_path_factory.mktemp('serve') / 'wd')
  loaded = mtp.load(workdir)
  with server.running(loaded, max_batch=4, max_wait_ms=20,
                      warmup=[('speculative', MAX_TOKENS)]) as (url, batcher):
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
  assert models['data'][0]['mtp']['decoders'] == ['speculative', 'autoregressive']
  page = httpx.get(url + '/')
  assert page.status_code == 200 and 'text/html' in page.headers['content-type']


def test_greedy_completions_equal_launch_generate_in_a_mixed_batch(served, client):
  url, batcher, loaded = served
  want = testing.references(loaded, PROMPTS, MAX_TOKENS)
  got, errors = {}, []

  def ask(prompt, stream):
    try:
      if stream:
        text, tokens = '', []
        for chunk in client.completions.create(model='anything', prompt=prompt,
                                               max_tokens=MAX_TOKENS, stream=True):
          text += chunk.choices[0].text if chunk.choices else ''
          if chunk.model_extra['mtp'].get('step') is not None:
            tokens += chunk.model_extra['mtp']['tokens']
      else:
        response = client.completions.create(model='anything', prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0)
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


@pytest.mark.parametrize('body, fragment', [
    (b'{not json', 'not valid JSON'),
    (b'[1, 2]', 'JSON object'),
    (json.dumps({'prompt': ''}).encode(), 'empty'),
    (json.dumps({'prompt': 'x', 'max_tokens': 0}).encode(), 'max_tokens'),
    (json.dumps({'prompt': 'x', 'max_tokens': '8'}).encode(), 'integer'),
    (json.dumps({'prompt': 'x', 'temperature': 'hot'}).encode(), 'number'),
    (json.dumps({'prompt': 7}).encode(), 'prompt'),
    (json.dumps({'prompt': 'x', 'stream': 'yes'}).encode(), 'boolean'),
    (json.dumps({'prompt': 'x', 'n': 2}).encode(), 'n must be 1'),
    (json.dumps({'prompt': 'x', 'stop': 3}).encode(), 'stop'),
    (json.dumps({'prompt': 'x' * 300, 'max_tokens': 8}).encode(), 'max_seq_len'),
    (json.dumps({'prompt': 'x', 'decoder': 'magic'}).encode(), 'decoder'),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, body, fragment):
  url = served[0]
  response = httpx.post(url + '/v1/completions', content=body,
                        headers={'content-type': 'application/json'})
  assert response.status_code == 400, response.text
  error = response.json()['error']
  assert fragment in error['message'] and error['type'] == 'invalid_request_error'
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
  assert 'mtp_cancelled_total 1' in metrics


def test_metrics_are_prometheus_text(served):
  # Its own request: under pytest-xdist this test may run before (or without) the others.
  ok = httpx.post(served[0] + '/v1/completions', json={'prompt': 'x', 'max_tokens': 2},
                  timeout=60)
  assert ok.status_code == 200
  text = httpx.get(served[0] + '/metrics').text
  for name in ('mtp_requests_total{endpoint="/v1/completions",code="200"}',
               'mtp_request_errors_total', 'mtp_queue_depth', 'mtp_completion_tokens_total',
               'mtp_tokens_per_step', 'mtp_request_latency_seconds_bucket{le="+Inf"}',
               'mtp_time_to_first_token_seconds_count'):
    assert name in text
  for line in text.splitlines():
    assert line.startswith('#') or len(line.split()) == 2, line


def test_a_request_joins_a_running_batch(served, client):
  url, batcher, loaded = served
  want = testing.references(loaded, [PROMPTS[1]], MAX_TOKENS)[PROMPTS[1]]
  seen = []

  def slow(jobs):  # Every chunk of a batch holding a SLOW request takes a while.
    if any(j.prompt.startswith('SLOW') for j in jobs):
      seen.append((len(jobs), len(batcher._active)))
      time.sleep(0.15)
  batcher.fault = slow
  try:
    with httpx.stream('POST', url + '/v1/completions', timeout=30,
                      json={'prompt': 'SLOW', 'max_tokens': MAX_TOKENS, 'stream': True}) as r:
      lines = r.iter_lines()
      next(lines)  # The slow row is decoding now.
      response = client.completions.create(model='m', prompt=PROMPTS[1],
                                            max_tokens=MAX_TOKENS, temperature=0)
      assert [line for line in lines if line][-1] == 'data: [DONE]'
  finally:
    batcher.fault = None
  assert response.model_extra['mtp']['tokens'] == want
  assert (2, 1) in seen  # Both rows in one running batch: the second joined the first.
  assert all(active == 1 for _, active in seen)


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
