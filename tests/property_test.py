"""Property-based tests of the decode validation layer (Hypothesis).

Random prompts, trees, lookup chains and sampling settings go through `driver.generate` (a
random tiny model) and `mtp.generate` (a tiny trained workdir). Every example either

  * raises a `ValueError` before anything is compiled (no call of the driver's jitted `_start`
    or `_run`, no head calibration or cost measurement), and does so whenever one of its
    settings is one the strategies know to be bad; or
  * runs, and then its tokens are ids of the vocabulary, each row stops at its EOS or after
    max_new_tokens, and greedy output (temperature 0, or a temperature so small that sampling
    is greedy) equals autoregressive greedy output token for token.

The strategies draw values, not shapes: prompt widths, batch sizes, max_new_tokens and sampling
settings come from small fixed sets, so the compiled decoders repeat across examples.

Example counts: the `ci` profile (the default) runs a bounded number per test, the same ones on
every run (derandomized: a stable, bounded CI); set `MTP_HYPOTHESIS_PROFILE=thorough` for a
longer local hunt, about ten times as many examples drawn afresh each run:

  MTP_HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -n 0 tests/property_test.py
"""

from __future__ import annotations

import contextlib
import math
import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

import mtp
from mtp.decode import driver
from mtp.model import testing as model_testing
from mtp.train import testing as train_testing

# The explain phase (which lines only failing examples run) takes minutes here: left out.
_PHASES = [p for p in Phase if p != Phase.explain]
settings.register_profile(
    'ci', max_examples=12, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile(
    'thorough', max_examples=150, deadline=None, database=None, print_blob=True,
    phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.load_profile(os.environ.get('MTP_HYPOTHESIS_PROFILE', 'ci'))
_SCALE = {'ci': 1, 'thorough': 10}[os.environ.get('MTP_HYPOTHESIS_PROFILE', 'ci')]

VOCAB = 61          # mtp.model.testing.tiny_config
MAX_SEQ_LEN = 128
WIDTH = 8           # Every driver prompt is [2, WIDTH]: one compiled shape family.


def _examples(n: int) -> int:
  return n * _SCALE


def _setting(good, bad, bad_percent: int = 12):
  """(value, known_bad): a good value mostly; shrinks towards good values."""
  return st.tuples(st.integers(0, 99), st.sampled_from(good), st.sampled_from(bad)).map(
      lambda t: (t[2], True) if t[0] >= 100 - bad_percent else (t[1], False))


@contextlib.contextmanager
def _compilations():
  """Counts the calls that compile (or run) a decoder: the driver's jitted entry points, and the
  head calibration and cost measurement behind tree='auto'."""
  from mtp.decode import calibration
  from mtp.decode import cost_model
  counts = {'n': 0}

  def counting(fn):
    def wrapped(*args, **kwargs):
      counts['n'] += 1
      return fn(*args, **kwargs)
    return wrapped

  with contextlib.ExitStack() as stack:
    for module, name in ((driver, '_start'), (driver, '_run'), (calibration, 'calibrate'),
                         (cost_model, 'step_cost')):
      stack.enter_context(mock.patch.object(module, name, counting(getattr(module, name))))
    yield counts


# ------------------------------------------------------------------------------------------
# driver.generate on a random tiny model.
# ------------------------------------------------------------------------------------------

_MODEL = None
_REFERENCE: dict = {}


def _model():
  global _MODEL
  if _MODEL is None:
    _MODEL = model_testing.tiny_model()
  return _MODEL


def _autoregressive(prompts: np.ndarray, lengths: np.ndarray, max_new_tokens: int, eos_id):
  """Greedy autoregressive tokens (numpy), cached per input."""
  key = (prompts.tobytes(), lengths.tobytes(), max_new_tokens, eos_id)
  if key not in _REFERENCE:
    out = driver.generate(_model(), prompts, lengths, max_new_tokens=max_new_tokens,
                          decoder='autoregressive', eos_id=eos_id)
    _REFERENCE[key] = (np.asarray(out.tokens), np.asarray(out.num_generated))
  return _REFERENCE[key]


# Rows that repeat themselves (prompt lookup finds matches), and random ones.
_ROWS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=WIDTH, max_size=WIDTH),
    st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=3).map(
        lambda r: (r * WIDTH)[:WIDTH]))

_TREES = [None, 1, 2, 3, [[0], [1], [0, 0]], [[0], [0, 0], [0, 0, 0], [1], [2]]]
_BAD_TREES = [0, 4, -1, [], [[]], [[0, 0]], [[0], [99999999999]], [[0.5]], [[True]],
              [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], 'bushy', [[-1]], True, 2.5]


@st.composite
def _driver_request(draw):
  rows = [draw(_ROWS) for _ in range(2)]
  lengths = [draw(st.integers(1, WIDTH)) for _ in range(2)]
  bad = {}

  def pick(name, good, bad_values, percent=12):
    value, is_bad = draw(_setting(good, bad_values, percent))
    if is_bad:
      bad[name] = value
    return value

  token_fault = pick('token', [None], ['negative', 'too_large'], 6)
  if token_fault:
    rows[0][draw(st.integers(0, lengths[0] - 1))] = -1 if token_fault == 'negative' else VOCAB
  length_fault = pick('length', [None], [0, WIDTH + 1, -3], 6)
  if length_fault is not None:
    lengths[1] = length_fault
  max_new_tokens = pick('max_new_tokens', [5, 9], [0, -2, MAX_SEQ_LEN, 2.5, True, '5'])
  decoder = pick('decoder', ['speculative', 'speculative', 'autoregressive'], ['beam', ''], 6)
  if decoder == 'autoregressive':
    tree = pick('tree', [None], _TREES[1:], 8)
    lookup = pick('lookup', [0], [1, 4], 8)
    tree_budget = pick('tree_budget', [0], [2], 6)
  else:
    tree = pick('tree', _TREES, _BAD_TREES)
    lookup = pick('lookup', [0, 0, 4], [-1, 65, 100_000, True, 2.0, None])
    # 2 nodes fit every tree; a dynamic tree takes no lookup chain.
    tree_budget = pick('tree_budget', [0, 0, 0, 2, 3 if tree is None else 2],
                       [1, -1, 100, True, 2.5, '3'], 8)
    if tree_budget and lookup and not {'tree_budget', 'lookup'} & set(bad):
      bad['tree_budget_with_lookup'] = tree_budget
  greedy = draw(st.integers(0, 2)) > 0
  if greedy:
    temperature = pick('temperature', [0, 0.0],
                       [-1.0, math.nan, math.inf, '0.5', None, True, -0.0 - 1e-9])
    top_k, top_p = pick('top_k', [0], [-1, VOCAB + 1, 2.5, True], 6), 1.0
  else:
    temperature = pick('temperature', [0.7, 1e-30], [-1.0, math.nan, math.inf, '0.5'])
    top_k = pick('top_k', [0, 5], [-1, VOCAB + 1, 2.5, True], 6)
    top_p = pick('top_p', [1.0, 0.9], [0, 0.0, 1.5, math.nan, -0.1, '1'], 6)
    if lookup and 'lookup' not in bad:
      bad['lookup_with_sampling'] = lookup
  eos_id = pick('eos_id', [None, 7], [-1, VOCAB, VOCAB + 100], 6)
  options = dict(tree=tree, lookup=lookup, temperature=temperature, top_k=top_k, top_p=top_p,
                 tree_budget=tree_budget)
  return dict(prompts=np.asarray(rows, np.int64), lengths=np.asarray(lengths),
              max_new_tokens=max_new_tokens, decoder=decoder, eos_id=eos_id,
              options=options, bad=bad)


def _check_output(tokens, num_generated, max_new_tokens, eos_id):
  """Ids in the vocabulary, each row's end at EOS or max_new_tokens, pad after the end."""
  assert tokens.shape == (2, max_new_tokens)
  assert ((tokens >= 0) & (tokens < VOCAB)).all(), tokens
  for row in range(2):
    n = int(num_generated[row])
    assert 1 <= n <= max_new_tokens
    generated = list(tokens[row, :n])
    if eos_id is not None and eos_id in generated:
      assert generated.index(eos_id) == n - 1
    else:
      assert n == max_new_tokens
    assert (tokens[row, n:] == 0).all()


def _driver_example(bad: dict, **changes):
  """A fixed example: valid settings but `changes` (the bad ones named in `bad`)."""
  request = dict(prompts=np.arange(16).reshape(2, WIDTH), lengths=np.asarray([WIDTH, 3]),
                 max_new_tokens=5, decoder='speculative', eos_id=None,
                 options=dict(tree=None, lookup=0, temperature=0.0, top_k=0, top_p=1.0,
                              tree_budget=0))
  options = {k: changes.pop(k) for k in list(changes) if k in request['options']}
  request.update(changes, bad=bad)
  request['options'].update(options)
  return example(request=request)


# The cases (issue 10: items 3, 4, 9 and 11), always run besides the drawn examples.
@_driver_example({'lookup': 100_000}, lookup=100_000)
@_driver_example({}, tree_budget=3, eos_id=7)
@_driver_example({'tree_budget_with_lookup': 3}, tree_budget=3, lookup=4)
@_driver_example({'lookup': 300}, lookup=300, decoder='autoregressive')
@_driver_example({'tree': [[0], [99999999999]]}, tree=[[0], [99999999999]])
@_driver_example({'tree': [[0.5]]}, tree=[[0.5]])
@_driver_example({'tree': [[True]]}, tree=[[True]])
@_driver_example({'temperature': '0.5'}, temperature='0.5')
@_driver_example({'temperature': math.inf}, temperature=math.inf)
@_driver_example({}, temperature=1e-30, top_k=5)
@settings(max_examples=_examples(16))
@given(request=_driver_request())
def test_driver_generate_rejects_before_compiling_or_matches_autoregressive(request):
  """driver.generate: a named ValueError with nothing compiled, or exact greedy output."""
  prompts, lengths = request['prompts'], request['lengths']
  max_new_tokens, eos_id, bad = request['max_new_tokens'], request['eos_id'], request['bad']
  with _compilations() as compiled:
    try:
      out = driver.generate(_model(), prompts, lengths, max_new_tokens=max_new_tokens,
                            decoder=request['decoder'], eos_id=eos_id, rng=3,
                            **request['options'])
    except ValueError as e:
      assert compiled['n'] == 0, f'compiled before raising {e!r}'
      assert str(e), 'a ValueError without a message'
      event('rejected')
      return
  assert not bad, f'accepted bad settings {bad}'
  tokens, num_generated = np.asarray(out.tokens), np.asarray(out.num_generated)
  _check_output(tokens, num_generated, max_new_tokens, eos_id)
  temperature = request['options'].get('temperature', 0)
  event(f'ran, temperature {temperature}')
  if temperature < 1e-6:
    expected, expected_n = _autoregressive(prompts, lengths, max_new_tokens, eos_id)
    np.testing.assert_array_equal(num_generated, expected_n)
    np.testing.assert_array_equal(tokens, expected)


# ------------------------------------------------------------------------------------------
# mtp.generate on a tiny trained workdir.
# ------------------------------------------------------------------------------------------

_LOADED = None


def _loaded(tmp_path_factory):
  global _LOADED
  if _LOADED is None:
    _LOADED = mtp.load(train_testing.train_tiny_workdir(tmp_path_factory.mktemp('property')))
  return _LOADED


_TEXT = st.one_of(
    st.text(min_size=1, max_size=24),
    st.sampled_from(['def f(x):\n    return', 'import os\nimport os\nimport', 'x = 1',
                     'aaaaaaaaaaaaaaaa', '\x00\x00', '\ud7ff\ue000', 'é€😀']))
_BAD_PROMPTS = [None, [], [''], ['ok', ''], ['ok', None], [b'bytes'], [1, 2], 'x' * 300,
                ['x' * 253]]  # 253 + max_new_tokens > max_seq_len 256
_API_TREES = [None, 'chain', 'default', 2, [[0], [1], [0, 0]]]
_API_BAD_TREES = ['bushy', '', 0, [[0.5]], [[True]], [[0], [99999999999]], [[0, 0, 0, 0]]]


@st.composite
def _api_request(draw):
  bad = {}

  def pick(name, good, bad_values, percent=10):
    value, is_bad = draw(_setting(good, bad_values, percent))
    if is_bad:
      bad[name] = value
    return value

  prompts = draw(st.lists(_TEXT, min_size=1, max_size=3))
  prompts = pick('prompts', [prompts], _BAD_PROMPTS, 8)
  kwargs = dict(max_new_tokens=pick('max_new_tokens', [6], [0, -1, 1000, 1.5, None], 8))
  decoder = pick('decoder', ['speculative', 'speculative', 'autoregressive'], ['beam'], 5)
  if decoder != 'autoregressive':
    kwargs['tree'] = pick('tree', _API_TREES, _API_BAD_TREES)
    kwargs['lookup'] = pick('lookup', [0, 0, 3], [-1, 65, 10**9, True, 1.5])
  greedy = draw(st.integers(0, 2)) > 0
  if greedy:
    kwargs['temperature'] = pick('temperature', [0.0], [-1.0, math.nan, math.inf, '0.5'])
  else:
    kwargs['temperature'] = pick('temperature', [0.8], [-1.0, math.nan, math.inf, '0.5'])
    kwargs['top_p'] = pick('top_p', [1.0, 0.9], [0.0, 2.0, math.nan], 6)
    if kwargs.get('lookup') and 'lookup' not in bad:
      bad['lookup_with_sampling'] = kwargs['lookup']
  kwargs['batch_size'] = pick('batch_size', [None, 2], [0, -1, 1.5, True], 6)
  return dict(prompts=prompts, decoder=decoder, kwargs=kwargs, bad=bad)


def _api_example(bad: dict, prompts=('x = 1',), decoder='speculative', **kwargs):
  kwargs = dict(dict(max_new_tokens=6, tree=None, lookup=0, temperature=0.0, batch_size=None),
                **kwargs)
  return example(request=dict(prompts=prompts, decoder=decoder, kwargs=kwargs, bad=bad))


@_api_example({'prompts': None}, prompts=None)
@_api_example({'temperature': '0.5'}, temperature='0.5')
@_api_example({'tree': [[0], [99999999999]]}, tree=[[0], [99999999999]])
# Found by this test: 'auto' measured the heads and the hardware before refusing the lookup.
@_api_example({'lookup': 10**9}, lookup=10**9, tree='auto')
@settings(max_examples=_examples(10))
@given(request=_api_request())
def test_api_generate_rejects_before_compiling_or_matches_autoregressive(request,
                                                                          tmp_path_factory):
  """mtp.generate: a named ValueError with nothing compiled, or exact greedy output."""
  loaded = _loaded(tmp_path_factory)
  prompts, kwargs, bad = request['prompts'], request['kwargs'], request['bad']
  with _compilations() as compiled:
    try:
      out = mtp.generate(loaded, prompts, decoder=request['decoder'], **kwargs)
    except ValueError as e:
      assert compiled['n'] == 0, f'compiled before raising {e!r}'
      assert str(e)
      event('rejected')
      return
  assert not bad, f'accepted bad settings {bad}'
  texts = [prompts] if isinstance(prompts, str) else list(prompts)
  assert [g.prompt for g in out] == texts
  tokenizer = loaded.tokenizer
  for g in out:
    assert all(0 <= t < tokenizer.vocab_size for t in g.tokens), g.tokens
    assert g.completion == tokenizer.decode(g.tokens)
    assert 1 <= len(g.tokens) <= kwargs['max_new_tokens']
  event(f'ran, temperature {kwargs["temperature"]}')
  if kwargs['temperature'] == 0:
    reference = mtp.generate(loaded, texts, max_new_tokens=kwargs['max_new_tokens'],
                             decoder='autoregressive', batch_size=kwargs['batch_size'])
    assert [g.tokens for g in out] == [g.tokens for g in reference]
