"""Property-based tests of the decode validation layer (Hypothesis).

Random prompts, trees, lookup chains and sampling settings go through the public door of the
decode engine (`plan.resolve`, `Engine.settings`, `Engine.generate`, through
`decode.testing.decode`, on a random tiny model) and through `mtp.generate` (the session's tiny
trained workdir). Every example either

  * raises a `ValueError` before any work starts (no decoder program compiled, as
    `engine.compilations()` counts them; no batch prefilled, no loop step run; no head
    calibration, cost curve or break-even measured), and does so whenever one of its settings
    is one the strategies know to be bad; or
  * runs, and then its tokens are ids of the vocabulary, each row stops at its EOS ('stop')
    or after max_new_tokens ('length'), and greedy output (temperature 0, or a temperature so
    small that sampling is greedy) equals autoregressive greedy output token for token.

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
from mtp.decode import engine as engine_lib
from mtp.decode import testing as decode_testing
from mtp.model import testing as model_testing

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
WIDTH = 8           # Every engine prompt is [2, WIDTH]: one compiled shape family.


def _examples(n: int) -> int:
  return n * _SCALE


def _setting(good, bad, bad_percent: int = 12):
  """(value, known_bad): a good value mostly; shrinks towards good values."""
  return st.tuples(st.integers(0, 99), st.sampled_from(good), st.sampled_from(bad)).map(
      lambda t: (t[2], True) if t[0] >= 100 - bad_percent else (t[1], False))


class _Work:
  """What a request started: decoder programs compiled (`engine.compilations()`, the public
  count), batches prefilled and loop steps run through an engine, measurements begun."""

  def __init__(self):
    self.compiled_before = engine_lib.compilations()
    self.calls: list[str] = []

  @property
  def started(self) -> list[str]:
    compiled = engine_lib.compilations() - self.compiled_before
    return self.calls + [f'{compiled} compilations'] * bool(compiled)


@contextlib.contextmanager
def _work():
  """Counts the work a request starts (`_Work`): the engine's prefills that got past their
  host checks (a prompt too long for the cache is refused there) and its loop steps, and the
  measurements behind measured trees and the `auto` policy (head accuracies, the hardware's
  cost curve, break-evens), all public functions."""
  from mtp.decode import auto
  from mtp.decode import calibration
  from mtp.decode import cost_model
  work = _Work()

  def counting(name, fn, after=False):
    def wrapped(*args, **kwargs):
      if not after:
        work.calls.append(name)
      out = fn(*args, **kwargs)
      if after:
        work.calls.append(name)
      return out
    return wrapped

  with contextlib.ExitStack() as stack:
    for owner, name, after in ((engine_lib.Engine, 'prefill', True),
                               (engine_lib.Engine, 'step', False),
                               (calibration, 'workdir_accuracies', False),
                               (calibration, 'calibrate', False),
                               (cost_model, 'step_cost', False),
                               (auto, 'break_even', False)):
      stack.enter_context(mock.patch.object(
          owner, name, counting(name, getattr(owner, name), after)))
    yield work


# ------------------------------------------------------------------------------------------
# The engine's door on a random tiny model.
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
    out = decode_testing.decode(_model(), prompts, lengths, decoder='autoregressive',
                                max_new_tokens=max_new_tokens, eos_id=eos_id)
    _REFERENCE[key] = (out.tokens, out.num_generated)
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
def _engine_request(draw):
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
  decoder = pick('decoder', ['speculative', 'speculative', 'auto', 'autoregressive'],
                 ['beam', ''], 6)
  if decoder == 'autoregressive':
    tree = pick('tree', [None], _TREES[1:], 8)
    lookup = pick('lookup', [0, None], [1, 4], 8)
    tree_budget = pick('tree_budget', [0], [2], 6)
  else:
    tree = pick('tree', _TREES, _BAD_TREES)
    lookup = pick('lookup', [0, 0, 4, None], [-1, 65, 100_000, True, 2.0, '4'])
    # 2 nodes fit every tree; a dynamic tree takes no lookup chain (a decoder's default one,
    # lookup None, gives way to it).
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
    # Lookup drafts verify sampled rows too (exactly): no longer a bad combination.
    temperature = pick('temperature', [0.7, 1e-30], [-1.0, math.nan, math.inf, '0.5'])
    top_k = pick('top_k', [0, 5], [-1, VOCAB + 1, 2.5, True], 6)
    top_p = pick('top_p', [1.0, 0.9], [0, 0.0, 1.5, math.nan, -0.1, '1'], 6)
  eos_id = pick('eos_id', [None, 7], [-1, VOCAB, VOCAB + 100], 6)
  options = dict(tree=tree, lookup=lookup, temperature=temperature, top_k=top_k, top_p=top_p,
                 tree_budget=tree_budget)
  return dict(prompts=np.asarray(rows, np.int64), lengths=np.asarray(lengths),
              max_new_tokens=max_new_tokens, decoder=decoder, eos_id=eos_id,
              options=options, bad=bad)


def _check_output(out, max_new_tokens, eos_id):
  """Ids in the vocabulary, each row's end at EOS ('stop') or max_new_tokens ('length'), pad
  after the end."""
  tokens, num_generated = out.tokens, out.num_generated
  assert tokens.shape == (2, max_new_tokens)
  assert ((tokens >= 0) & (tokens < VOCAB)).all(), tokens
  for row in range(2):
    n = int(num_generated[row])
    assert 1 <= n <= max_new_tokens
    generated = list(tokens[row, :n])
    if eos_id is not None and eos_id in generated:
      assert generated.index(eos_id) == n - 1
      assert out.finish_reason(row) == 'stop'
    else:
      assert n == max_new_tokens
      assert out.finish_reason(row) == 'length'
    assert (tokens[row, n:] == 0).all()


def _engine_example(bad: dict, **changes):
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
@_engine_example({'lookup': 100_000}, lookup=100_000)
@_engine_example({}, tree_budget=3, eos_id=7)
@_engine_example({'tree_budget_with_lookup': 3}, tree_budget=3, lookup=4)
@_engine_example({'lookup': 300}, lookup=300, decoder='autoregressive')
@_engine_example({'tree': [[0], [99999999999]]}, tree=[[0], [99999999999]])
@_engine_example({'tree': [[0.5]]}, tree=[[0.5]])
@_engine_example({'tree': [[True]]}, tree=[[True]])
@_engine_example({'temperature': '0.5'}, temperature='0.5')
@_engine_example({'temperature': math.inf}, temperature=math.inf)
@_engine_example({}, temperature=1e-30, top_k=5)
# Issue 24: lookup drafts are verified for sampled rows too; 'auto' drafts by lookup by default,
# a default that gives way to a dynamic tree.
@_engine_example({}, lookup=4, temperature=0.7, top_p=0.9)
@_engine_example({}, tree_budget=3, lookup=None, decoder='auto')
@_engine_example({'tree_budget_with_lookup': 3}, tree_budget=3, lookup=4, decoder='auto')
@settings(max_examples=_examples(16))
@given(request=_engine_request())
def test_engine_rejects_before_any_work_or_matches_autoregressive(request):
  """plan.resolve and the engine: a named ValueError before any work, or exact greedy output."""
  prompts, lengths = request['prompts'], request['lengths']
  max_new_tokens, eos_id, bad = request['max_new_tokens'], request['eos_id'], request['bad']
  options = dict(request['options'])
  temperature, top_k, top_p = (options.pop(k) for k in ('temperature', 'top_k', 'top_p'))
  with _work() as work:
    try:
      out = decode_testing.decode(_model(), prompts, lengths, decoder=request['decoder'],
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=3, eos_id=eos_id, **options)
    except ValueError as e:
      assert not work.started, f'{work.started} before raising {e!r}'
      assert str(e), 'a ValueError without a message'
      event('rejected')
      return
  assert not bad, f'accepted bad settings {bad}'
  _check_output(out, max_new_tokens, eos_id)
  event(f'ran {request["decoder"]}, temperature {temperature}')
  if temperature < 1e-6:
    expected, expected_n = _autoregressive(prompts, lengths, max_new_tokens, eos_id)
    np.testing.assert_array_equal(out.num_generated, expected_n)
    np.testing.assert_array_equal(out.tokens, expected)


# Found by the test above in the thorough profile: a tree that is neither a name, a chain length
# nor choices (True, 2.5) reaches `trees.tree_from_choices`, which iterates over it.
@pytest.mark.parametrize('tree', [True, 2.5])
def test_a_tree_neither_named_nor_a_length_nor_choices_is_named(tree):
  with pytest.raises(ValueError, match='tree|chain'):
    decode_testing.engine(_model(), max_new_tokens=5, tree=tree)


# ------------------------------------------------------------------------------------------
# mtp.generate on the session's tiny trained workdir.
# ------------------------------------------------------------------------------------------

_LOADED = None


def _loaded(workdir):
  global _LOADED
  if _LOADED is None:
    _LOADED = mtp.load(workdir)
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
  decoder = pick('decoder', ['speculative', 'speculative', 'auto', 'autoregressive'], ['beam'],
                 5)
  if decoder != 'autoregressive':
    kwargs['tree'] = pick('tree', _API_TREES, _API_BAD_TREES)
    # None: the decoder's default (mtp.generate drops None options).
    kwargs['lookup'] = pick('lookup', [0, 0, 3, None], [-1, 65, 10**9, True, 1.5])
  greedy = draw(st.integers(0, 2)) > 0
  if greedy:
    kwargs['temperature'] = pick('temperature', [0.0], [-1.0, math.nan, math.inf, '0.5'])
  else:
    # Lookup drafts verify sampled rows too (exactly): no longer a bad combination.
    kwargs['temperature'] = pick('temperature', [0.8], [-1.0, math.nan, math.inf, '0.5'])
    kwargs['top_p'] = pick('top_p', [1.0, 0.9], [0.0, 2.0, math.nan], 6)
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
@_api_example({'lookup': 10**9}, lookup=10**9, decoder='auto')
@_api_example({}, prompts=('import os\nimport os\nimport', 'x'), lookup=3, temperature=0.8,
              top_p=0.9)
@settings(max_examples=_examples(10))
@given(request=_api_request())
def test_api_generate_rejects_before_any_work_or_matches_autoregressive(request, tiny_workdir):
  """mtp.generate: a named ValueError before any work, or exact greedy output."""
  loaded = _loaded(tiny_workdir)
  prompts, kwargs, bad = request['prompts'], request['kwargs'], request['bad']
  with _work() as work:
    try:
      out = mtp.generate(loaded, prompts, decoder=request['decoder'], **kwargs)
    except ValueError as e:
      assert not work.started, f'{work.started} before raising {e!r}'
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
    # A stop id (EOS) ends a completion as 'stop' (it was 'eos'), its budget as 'length'.
    stopped = g.tokens[-1] == tokenizer.eos_id
    assert g.finish_reason == ('stop' if stopped else 'length'), g
    assert stopped or len(g.tokens) == kwargs['max_new_tokens']
  event(f'ran {request["decoder"]}, temperature {kwargs["temperature"]}')
  if kwargs['temperature'] == 0:
    reference = mtp.generate(loaded, texts, max_new_tokens=kwargs['max_new_tokens'],
                             decoder='autoregressive', batch_size=kwargs['batch_size'])
    assert [g.tokens for g in out] == [g.tokens for g in reference]
