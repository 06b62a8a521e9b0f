"""The decode loop compiles once per decoder, whatever changes between calls at run time."""

import chex
import jax
import numpy as np
import pytest

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
