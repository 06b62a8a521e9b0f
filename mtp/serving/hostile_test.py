"""The server against a hostile client (issue 28): forged metrics, unbounded and slow bodies,
bodies that once got 500s, idle connections, and properties over random bodies and paths.

One real server on localhost with small limits: 64 KiB bodies, requests that must arrive
within 2 s, 12 connections.
"""

import collections
import concurrent.futures
import json
import socket
import threading
import time
import urllib.parse

import httpx2 as httpx
import hypothesis
from hypothesis import strategies as st
from prometheus_client import parser as prometheus_parser
import pytest

import mtp
from mtp.serving import server

MAX_BYTES = 64 << 10
TIMEOUT_S = 2.0
MAX_CONNECTIONS = 12
KNOWN = {'prompt': 'def f(x):', 'max_tokens': 6, 'temperature': 0}


@pytest.fixture(scope='module')
def served(tiny_workdir):
  loaded = mtp.load(tiny_workdir)
  with server.running(loaded, max_batch=4, decoders=('autoregressive',),
                      max_request_bytes=MAX_BYTES, request_timeout_s=TIMEOUT_S,
                      max_connections=MAX_CONNECTIONS) as (url, batcher):
    assert batcher.warm.wait(300) and batcher.startup_error is None
    known = httpx.post(url + '/v1/completions', json=KNOWN, timeout=60).json()
    yield url, loaded, known['choices'][0]['text']


def _address(url):
  parsed = urllib.parse.urlparse(url)
  return parsed.hostname, parsed.port


def _raw(url, data: bytes, timeout: float = 10.0) -> bytes:
  """Sends `data` on a fresh connection and reads until the server closes it or `timeout`."""
  with socket.create_connection(_address(url), timeout=timeout) as sock:
    sock.sendall(data)
    return _read_all(sock)


def _read_all(sock) -> bytes:
  out = b''
  try:
    while chunk := sock.recv(65536):
      out += chunk
  except (socket.timeout, ConnectionResetError):
    pass
  return out


def _status(response: bytes) -> int:
  return int(response.split(b' ', 2)[1]) if response.startswith(b'HTTP/1.1') else 0


def _metrics(url) -> dict:
  text = httpx.get(url + '/metrics', timeout=30).text
  return {family.name: family for family in prometheus_parser.text_string_to_metric_families(
      text)}


def _still_serves(url, text):
  answer = httpx.post(url + '/v1/completions', json=KNOWN, timeout=60)
  assert answer.status_code == 200 and answer.json()['choices'][0]['text'] == text


# ---------------------------------------------------------------------------- /metrics


def test_a_path_cannot_forge_a_metric_and_404s_share_one_label(served):
  url, _, _ = served
  forged = '/x%22%7D%201%0Amtp_injected_total%7Bendpoint%3D%22a%22%7D%2042%0A'
  assert httpx.get(url + forged).status_code == 404
  for i in range(50):
    assert httpx.get(f'{url}/random/{i}/{"%0A" * (i % 3)}').status_code == 404
  families = _metrics(url)
  assert 'mtp_injected' not in families
  endpoints = {s.labels['endpoint'] for s in families['mtp_requests'].samples}
  assert 'unmatched' in endpoints
  assert all(e == 'unmatched' or e.startswith('/') and '\n' not in e for e in endpoints)
  assert len(endpoints) <= 10  # Routes, not paths.


# ---------------------------------------------------------------------------- bodies


def test_a_body_declared_too_large_gets_413_before_it_is_sent(served):
  url, _, text = served
  host, port = _address(url)
  start = time.monotonic()
  response = _raw(url, (f'POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n'
                        'Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n'
                        '{"prompt": "').encode())
  assert _status(response) == 413 and time.monotonic() - start < TIMEOUT_S
  error = json.loads(response.split(b'\r\n\r\n', 1)[1])['error']
  assert error['code'] == 'request_too_large' and str(MAX_BYTES) in error['message']
  _still_serves(url, text)


def test_a_chunked_body_that_grows_too_large_gets_413(served):
  url, _, text = served
  host, _ = _address(url)
  chunk = b'a' * 8192
  with socket.create_connection(_address(url), timeout=10) as sock:
    sock.sendall(f'POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n'
                 'Transfer-Encoding: chunked\r\n\r\n'.encode())
    try:
      for _ in range(MAX_BYTES // len(chunk) + 2):
        sock.sendall(b'%x\r\n%s\r\n' % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
      pass  # Closed after its 413: the rest is not read.
    assert _status(_read_all(sock)) == 413
  _still_serves(url, text)


def test_parsing_and_tokenizing_run_off_the_event_loop(served, monkeypatch):
  """A prompt whose tokenizing blocks until /health has answered: on the event loop, /health
  could never answer."""
  url, loaded, _ = served
  answered = threading.Event()
  encode = loaded.tokenizer.encode

  def slow_encode(text, *args, **kwargs):
    if text == 'slow prompt':
      assert answered.wait(20), '/health did not answer while a prompt was being tokenized'
    return encode(text, *args, **kwargs)
  monkeypatch.setattr(loaded.tokenizer, 'encode', slow_encode)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pending = pool.submit(httpx.post, url + '/v1/completions', timeout=60,
                          json={'prompt': 'slow prompt', 'max_tokens': 2})
    time.sleep(0.2)
    assert httpx.get(url + '/health', timeout=10).status_code == 200
    answered.set()
    assert pending.result().status_code == 200


@pytest.mark.parametrize('body', [
    '[' * 100_000 + ']' * 100_000,  # Nesting deeper than the parser's recursion.
    '{"prompt": "x", "max_tokens": ' + '9' * 5000 + '}',  # Past int()'s 4300 digits.
    '{"prompt": "x", "max_tokens": 9223372036854775808}',
    '{"prompt": "x", "top_k": 9223372036854775808}',
    '{"prompt": "x", "n": 9223372036854775808}',
    '{"prompt": "x", "logprobs": 9223372036854775808}',
    '{"prompt": "\\ud800"}',  # A lone surrogate.
    '{"prompt": "x", "stop": ["\\udfff"]}',
    '{"prompt": "x", "temperature": 1e999}',
    '{"prompt": "x", "max_tokens": 1.0e2}',
    '{"prompt": "x", "decoder": {"a": 1}}',
    '\xff\xfe',
])
def test_bodies_that_once_got_500_get_400(served, body):
  url, _, text = served
  response = httpx.post(url + '/v1/completions', content=body.encode('utf-8', 'surrogatepass'),
                        headers={'content-type': 'application/json'}, timeout=60)
  assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
  assert set(response.json()['error']) >= {'message', 'type', 'param', 'code'}


@pytest.mark.parametrize('seed', [2 ** 63, -2 ** 63 - 1, 2 ** 200])
def test_any_integer_seed_is_a_seed(served, seed):
  """Seeds are taken modulo 2**64 (`decode/settings.py`): huge ones are not errors."""
  url, _, _ = served
  response = httpx.post(url + '/v1/completions', timeout=60, json={
      'prompt': 'x', 'max_tokens': 2, 'temperature': 1.0, 'seed': seed})
  assert response.status_code == 200


@pytest.mark.parametrize('body', [
    '{"prompt": "x", "max_tokens": 2, "stop": "' + 'y' * 10_000 + '"}',
    '{"prompt": "x", "max_tokens": 2' + ', "a": 1' * 5000 + '}',
])
def test_big_but_valid_bodies_are_served(served, body):
  response = httpx.post(served[0] + '/v1/completions', content=body, timeout=60,
                        headers={'content-type': 'application/json'})
  assert response.status_code == 200


def test_chat_with_a_lone_surrogate_gets_400(served):
  url, _, _ = served
  body = '{"messages": [{"role": "user", "content": "\\udc00"}]}'
  response = httpx.post(url + '/v1/chat/completions', content=body, timeout=60,
                        headers={'content-type': 'application/json'})
  assert response.status_code == 400 and response.json()['error']['param'] == 'messages'


# ---------------------------------------------------------------------------- slow clients


def test_slow_clients_are_dropped_and_connections_are_capped(served):
  url, _, text = served
  host, _ = _address(url)
  partial = [b'POST /v1/completions HTTP/1.1\r\nHost: h\r\n',  # Headers never end.
             b'POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\n{"pr']
  socks = []
  try:
    for i in range(MAX_CONNECTIONS - 1):  # uvicorn counts the refused one too.
      sock = socket.create_connection(_address(url), timeout=3 * TIMEOUT_S)
      sock.sendall(partial[i % 2])
      socks.append(sock)
    time.sleep(0.2)
    # Every connection is taken: a new request is refused, not queued behind them.
    over = httpx.get(url + '/health', timeout=10)
    assert over.status_code == 503
    start = time.monotonic()
    answers = [_read_all(sock) for sock in socks]
    assert time.monotonic() - start < 2 * TIMEOUT_S
    assert [_status(a) for a in answers] == [408] * len(socks), answers
  finally:
    for sock in socks:
      sock.close()
  _still_serves(url, text)


def test_a_long_answer_is_not_cut_by_the_request_deadline(served):
  url, _, _ = served
  with httpx.stream('POST', url + '/v1/completions', timeout=60,
                    json={'prompt': 'x', 'max_tokens': 40, 'stream': True}) as response:
    lines = []
    for line in response.iter_lines():
      lines.append(line)
      if len(lines) == 2:
        time.sleep(TIMEOUT_S * 1.5)  # The client reads slowly; the server keeps sending.
  assert lines[-2:] == ['data: [DONE]', ''] or 'data: [DONE]' in lines


# ---------------------------------------------------------------------------- properties

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
_FIELDS = ('prompt', 'messages', 'max_tokens', 'temperature', 'top_p', 'top_k', 'seed', 'stop',
           'n', 'logprobs', 'top_logprobs', 'stream', 'decoder', 'echo', 'best_of',
           'max_completion_tokens', 'presence_penalty')
_small_ints = st.integers(min_value=-3, max_value=12)
_value = st.one_of(_json, _small_ints, st.text(alphabet=st.characters(), max_size=40),
                   st.integers(min_value=2 ** 62, max_value=2 ** 70))
_valid = st.fixed_dictionaries(
    {'prompt': st.text(min_size=1, max_size=40), 'max_tokens': st.integers(1, 8)},
    optional={'temperature': st.floats(0, 2), 'top_p': st.floats(0.01, 1),
              'top_k': st.integers(0, 50), 'seed': st.integers(), 'n': st.integers(1, 2),
              'stop': st.lists(st.text(min_size=1, max_size=4), max_size=2),
              'logprobs': st.integers(0, 5), 'stream': st.booleans()})
_bodies = st.one_of(
    _valid,
    st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=6),
    st.fixed_dictionaries({'prompt': st.text(min_size=1, max_size=40),
                           'max_tokens': _small_ints},
                          optional={f: _value for f in _FIELDS[3:]}),
    st.fixed_dictionaries({'messages': st.lists(st.fixed_dictionaries(
        {'role': st.sampled_from(['user', 'system', 'assistant', 'tool']),
         'content': st.text(max_size=30) | _json}), min_size=1, max_size=3),
        'max_tokens': _small_ints}))


_PROPERTY = dict(deadline=None, derandomize=True,
                 suppress_health_check=list(hypothesis.HealthCheck))


def test_property_any_body_gets_2xx_or_4xx_with_an_error_object(served):
  """Then the known greedy request still answers the same (in this test: xdist may run the
  module's tests on different workers, each with its own server)."""
  url, _, text = served
  answers = collections.Counter()

  @hypothesis.settings(max_examples=150, **_PROPERTY)
  @hypothesis.given(body=_bodies, chat=st.booleans(),
                    raw=st.sampled_from([None, None, None, 'cut', 'bytes']))
  def check(body, chat, raw):
    content = json.dumps(body).encode()
    if raw == 'cut':
      content = content[:len(content) // 2]
    elif raw == 'bytes':
      content = content.replace(b'"', b'\xff', 1)
    path = '/v1/chat/completions' if chat else '/v1/completions'
    response = httpx.post(url + path, content=content, timeout=60,
                          headers={'content-type': 'application/json'})
    assert response.status_code < 500, (body, response.text[:300])
    answers[f'{response.status_code // 100}xx'] += 1
    if response.status_code >= 400:
      error = response.json()['error']
      assert isinstance(error['message'], str) and error['type']
    elif not body.get('stream'):
      assert response.json()['choices']
  check()
  # Both kinds of answer were exercised, not only refusals.
  assert answers['2xx'] >= 10 and answers['4xx'] >= 10, answers
  print(f'answers: {dict(answers)}')
  _still_serves(url, text)


def test_property_metrics_always_parse_and_stay_bounded(served):
  url, _, text = served

  @hypothesis.settings(max_examples=60, **_PROPERTY)
  @hypothesis.given(path=st.text(alphabet=st.characters(codec='utf-8'), max_size=30),
                    method=st.sampled_from(['GET', 'POST', 'PUT', 'DELETE']))
  def check(path, method):
    quoted = urllib.parse.quote(path, safe='/')
    httpx.request(method, f'{url}/{quoted}', timeout=30, content=b'{}')
    families = _metrics(url)
    series = {tuple(sorted(s.labels.items())) for s in families['mtp_requests'].samples}
    assert len(series) <= 40, series  # Routes x statuses, whatever the paths.
  check()
  _still_serves(url, text)
