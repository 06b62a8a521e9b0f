"""The decode loop compiles once per decoder, whatever changes between calls at run time."""

import chex
import jax
import numpy as np
import pytest
from scipy import stats

from mtp.decode import driver
from mtp.decode import state as state_lib
from mtp.model import testing

WIDTH, MAX_NEW = 8, 12


def _counted(jitted, static, donate=()):
  """`jitted` compiled afresh from its Python function, failing on a second trace."""
  chex.clear_trace_counter()  # Counts are kept per definition site, across tests.
  return jax.jit(chex.assert_max_traces(jitted.__wrapped__, n=1), static_argnames=static,
                 donate_argnames=donate)


@pytest.mark.parametrize('decoder', ['autoregressive', 'speculative'])
def test_one_trace_across_prompts_lengths_seeds_eos_and_chunks(monkeypatch, decoder):
  monkeypatch.setattr(driver, '_start', _counted(driver._start, ('structure', 'request')))
  monkeypatch.setattr(driver, '_run', _counted(driver._run, ('structure', 'request'),
                                               ('state',)))
  model = testing.tiny_model(0)
  options = dict(max_new_tokens=MAX_NEW, decoder=decoder, temperature=0.7, top_k=20)
  rng = np.random.default_rng(0)
  for call in range(4):
    prompts = testing.random_tokens((3, WIDTH), 61, seed=call)
    lengths = rng.integers(1, WIDTH + 1, 3)
    # A fresh split each time: equal models share the compiled loop.
    prepared = state_lib.PreparedModel(model)
    special = dict(rng=call, eos_id=call + 5, pad_id=call)
    out = driver.generate(prepared, prompts, lengths, **special, **options)
    chex.assert_shape(out.tokens, (3, MAX_NEW))
    chex.assert_tree_all_finite(out.mean_accepted)
    chunks = list(driver.generate_chunks(model, prompts, lengths, steps_per_chunk=call + 1,
                                         **special, **options))
    np.testing.assert_array_equal(chunks[-1].tokens, out.tokens)  # Same seed, same output.


def test_a_new_request_compiles_a_new_decoder(monkeypatch):
  monkeypatch.setattr(driver, '_run', _counted(driver._run, ('structure', 'request'),
                                               ('state',)))
  model = testing.tiny_model(0)
  prompts = testing.random_tokens((2, WIDTH), 61)
  driver.generate(model, prompts, max_new_tokens=MAX_NEW)
  with pytest.raises(AssertionError, match='traced'):  # The counter is live: it catches one.
    driver.generate(model, prompts, max_new_tokens=MAX_NEW + 1)


# Ids a tokenizer of 50 ids with pad 0 can emit, from a model whose output layer has 61.
VOCAB_LIMIT, PAD = 50, 0
ROWS, NEW = 96, 3


def _emitted(model, decoder, temperature, seed):
  out = driver.generate(model, testing.random_tokens((ROWS, 4), 61, seed=9), max_new_tokens=NEW,
                        decoder=decoder, temperature=temperature, rng=seed,
                        vocab_limit=VOCAB_LIMIT, banned_ids=(PAD,))
  return np.asarray(out.tokens)


@pytest.mark.parametrize('temperature', [1e-45, 1e-30, 1e-10, 1.0, 1e3])
def test_every_temperature_emits_decodable_ids_alike_in_both_decoders(temperature):
  """Tiny temperatures once made the rejection sampler emit pad ids (softmax(logits / T) was
  NaN); huge ones sampled ids past the tokenizer. Both decoders mask alike and agree."""
  model = state_lib.PreparedModel(testing.tiny_model(0))
  ar = _emitted(model, 'autoregressive', temperature, 1)
  spec = _emitted(model, 'speculative', temperature, 2)
  for tokens in (ar, spec):
    assert np.all((tokens > PAD) & (tokens < VOCAB_LIMIT)), np.unique(tokens)
  if temperature <= 1e-10:  # Sampling at such temperatures is greedy decoding.
    greedy = _emitted(model, 'autoregressive', 0.0, 0)
    np.testing.assert_array_equal(ar, greedy)
    np.testing.assert_array_equal(spec, greedy)
  else:  # The same distribution: a two-sample chi-square test on every emitted token.
    counts = np.stack([np.bincount(t.ravel(), minlength=VOCAB_LIMIT) for t in (ar, spec)])
    counts = counts[:, counts.sum(0) > 0]
    assert stats.chi2_contingency(counts)[1] > 1e-4


@pytest.mark.parametrize('options,message', [
    (dict(temperature=float('inf')), 'temperature must be >= 0 .* a finite number'),
    (dict(temperature='0.5'), 'temperature must be >= 0 .* a finite number'),
    (dict(temperature=True), 'temperature must be >= 0 .* a finite number'),
    (dict(top_p='1'), 'top_p must be in'),
    (dict(lookup=65), r'lookup \(--lookup\) must be at most 64'),
    (dict(lookup=65, decoder='autoregressive'), r'lookup \(--lookup\) must be at most 64'),
    (dict(tree=[[0], [2 ** 40]]), 'outside'),
    (dict(vocab_limit=62), 'vocab_limit must be an integer in'),
    (dict(banned_ids=(61,)), 'outside the vocabulary'),
])
def test_bad_options_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    driver.generate(testing.tiny_model(0), testing.random_tokens((1, 4), 61), max_new_tokens=2,
                    **options)
