"""decode.auto: drafting's break-even, measured on the decoder's own loop and cached."""

import json

import numpy as np
import pytest

import mtp
from mtp.decode import auto
from mtp.decode import driver
from mtp.decode import request as request_lib
from mtp.model import testing
from mtp.train import testing as train_testing

LENGTHS = np.array([5, 7], np.int32)


@pytest.fixture(scope='module')
def model():
  return testing.tiny_model(0, mtp_num_heads=2)


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((2, 7), 61, seed=2)


def _request(model, **options):
  return request_lib.make_request(model.cfg, 7, max_new_tokens=12, decoder='auto', **options)


def test_measured_once_then_read_from_the_cache(model, prompts, tmp_path, monkeypatch):
  calls = []

  # Drafting steps cost 3 ms; one-token steps 2 ms, but a burst of load hits one of them.
  one_token = iter([0.002, 0.002, 0.006, 0.002, 0.002] * 4)

  def timed(*args, drafting, warm_up, **kwargs):
    calls.append((drafting, warm_up))
    return 0.003 if drafting else next(one_token)

  monkeypatch.setattr(driver, 'seconds_per_step', timed)
  request = _request(model)
  assert auto.break_even(model, prompts, LENGTHS, request, cache_dir=tmp_path) == 1.5
  assert auto.break_even(model, prompts, LENGTHS, request, cache_dir=tmp_path) == 1.5
  # One compiling run, then five pairs taking turns; the second call reads the cache.
  assert calls == [(True, True)] + [(True, False), (False, False)] * 5
  # Another block is another entry; refresh measures again.
  auto.break_even(model, prompts, LENGTHS, _request(model, tree=1), cache_dir=tmp_path)
  auto.break_even(model, prompts, LENGTHS, request, cache_dir=tmp_path, refresh=True)
  assert len(calls) == 33
  table = json.loads((tmp_path / 'break_even.json').read_text())
  assert len(table) == 2 and all(len(v['ratios']) == 5 for v in table.values())
  # A corrupt entry is measured again, not trusted.
  key = auto.cache_key(model, request, 2, 7)
  table[key]['break_even'] = 'fast'
  (tmp_path / 'break_even.json').write_text(json.dumps(table))
  assert auto.break_even(model, prompts, LENGTHS, request, cache_dir=tmp_path) == 1.5
  assert len(calls) == 44


def test_the_probe_keeps_the_worst_case_within_five_percent():
  assert auto.probe_steps(0.9, 128) == 8  # Drafting is free: the longest probe.
  assert auto.probe_steps(2.0, 128) == 6  # 6 steps lose at most 6 of 128 one-token steps.
  assert auto.probe_steps(3.4, 128) == 2
  assert auto.probe_steps(30.0, 16) == 1  # At least one step: drafting is tried.
  assert auto.probe_steps(1.1, 1000) == 8
  # A floor for kinds of step whose acceptance swings (lookup): it bounds the worst case then.
  assert auto.probe_steps(4.35, 128) == 1 and auto.probe_steps(4.35, 128, least=4) == 4


def test_a_request_that_cannot_fall_back_is_refused(model, prompts, tmp_path):
  plain = request_lib.make_request(model.cfg, 7, max_new_tokens=12, decoder='speculative')
  with pytest.raises(ValueError, match="'auto' request"):
    auto.break_even(model, prompts, LENGTHS, plain, cache_dir=tmp_path)


def test_the_real_measurement_is_a_positive_ratio(model, prompts, tmp_path):
  ratio = auto.break_even(model, prompts, LENGTHS, _request(model), cache_dir=tmp_path,
                          steps=4, repeats=2)
  assert 0 < ratio < 100


def test_generate_defaults_to_auto_and_stays_exact(tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  loaded = mtp.load(train_testing.train_tiny_workdir(tmp_path / 'workdir'))
  prompts = ['def f(x):\n    return', 'import os\n']
  auto_out = mtp.generate(loaded, prompts, max_new_tokens=12)
  plain = mtp.generate(loaded, prompts, max_new_tokens=12, decoder='autoregressive')
  assert [g.tokens for g in auto_out] == [g.tokens for g in plain]
  # Greedy 'auto' adds lookup drafts: both kinds of step are measured (the whole block and
  # the heads' block alone).
  table = json.loads((tmp_path / 'cache' / 'break_even.json').read_text())
  assert len(table) == 2 and sum(key.endswith('|heads') or '|heads|' in key for key in table) == 1
  assert all(entry['break_even'] > 0 for entry in table.values())
