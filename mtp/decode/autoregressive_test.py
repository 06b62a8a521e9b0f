"""Autoregressive decoding: equals a naive full-forward loop; stopping; chunks; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import autoregressive
from mtp.decode import driver
from mtp.decode import state as state_lib
from mtp.model import testing

PROMPT_LENGTHS = np.array([7, 3, 5], np.int32)
MAX_NEW = 16  # The same shapes as speculative_test: one compiled reference.


@pytest.fixture(scope='module')
def model():
  return testing.tiny_model(0, mtp_num_heads=0)


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((3, 7), 61, seed=1)


def _naive_greedy(model, prompts, lengths, max_new_tokens):
  """Greedy decoding by re-running the whole sequences without a cache for every token."""
  b, width = prompts.shape[0], prompts.shape[1] + max_new_tokens
  # One compiled full forward over a fixed width: causal attention ignores what lies after.
  forward = jax.jit(lambda seq: model.logits(model(seq, jnp.arange(width)[None])[0]))
  seq = np.zeros((b, width), np.int32)
  seq[:, :prompts.shape[1]] = prompts
  for i in range(max_new_tokens):
    best = np.asarray(jnp.argmax(forward(jnp.asarray(seq)), axis=-1))
    seq[np.arange(b), lengths + i] = best[np.arange(b), lengths + i - 1]
  return np.stack([seq[r, n:n + max_new_tokens] for r, n in enumerate(lengths)])


@pytest.fixture(scope='module')
def reference(model, prompts):
  return _naive_greedy(model, prompts, PROMPT_LENGTHS, MAX_NEW)


def test_greedy_equals_uncached_decoding_with_ragged_prompts(model, prompts, reference):
  out = autoregressive.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, reference)
  np.testing.assert_array_equal(out.num_generated, [MAX_NEW] * 3)
  np.testing.assert_array_equal(out.num_steps, [MAX_NEW - 1] * 3)  # The prefill gives one.
  np.testing.assert_allclose(out.mean_accepted, 1.0)


def test_eos_stops_each_row_without_recompiling(model, prompts, reference):
  autoregressive.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW)
  compiled = driver._run._cache_size(), driver._start._cache_size()
  eos = int(reference[1, 4])
  out = autoregressive.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                                eos_id=eos, pad_id=-1)
  assert (driver._run._cache_size(), driver._start._cache_size()) == compiled
  for b in range(3):
    hits = np.nonzero(reference[b] == eos)[0]
    n = hits[0] + 1 if hits.size else MAX_NEW
    assert out.num_generated[b] == n
    np.testing.assert_array_equal(out.tokens[b, :n], reference[b, :n])
    assert np.all(np.asarray(out.tokens[b, n:]) == -1)
    assert out.num_steps[b] == n - 1


def test_chunks_yield_growing_prefixes_of_the_same_output(model, prompts, reference):
  chunks = list(autoregressive.generate_chunks(model, prompts, PROMPT_LENGTHS,
                                               max_new_tokens=MAX_NEW, steps_per_chunk=4))
  assert [c.num_generated.tolist() for c in chunks] == [[n] * 3 for n in (1, 5, 9, 13, 16)]
  np.testing.assert_array_equal(chunks[-1].tokens, reference)


@pytest.mark.parametrize('change,message', [
    (dict(prompt_lengths=[7, 0, 5]), 'empty prompt in row 1'),
    (dict(max_new_tokens=122), 'exceeds the model position limit max_seq_len=128'),
    (dict(max_new_tokens=0), 'max_new_tokens must be a positive integer'),
    (dict(temperature=-0.5), 'temperature must be >= 0'),
    (dict(top_p=0.0), r'top_p must be in \(0, 1\]'),
    (dict(top_p=1.5), r'top_p must be in \(0, 1\]'),
    (dict(eos_id=61), 'eos_id 61 is outside the vocabulary'),
    (dict(cache_capacity=11), 'cache_capacity 11 is too small'),
])
def test_bad_input_is_named_before_compiling(model, prompts, change, message):
  kwargs = {**dict(prompt_lengths=PROMPT_LENGTHS, max_new_tokens=4), **change}
  lengths = kwargs.pop('prompt_lengths')
  with pytest.raises(ValueError, match=message):
    autoregressive.generate(model, prompts, lengths, **kwargs)


def test_token_outside_vocabulary_is_named(model):
  bad = np.array([[1, 2, 3], [4, 61, 0]])
  with pytest.raises(ValueError, match=r'token id 61 at prompt row 1, position 1'):
    autoregressive.generate(model, bad, max_new_tokens=2)
  with pytest.raises(ValueError, match='empty prompt'):
    autoregressive.generate(model, np.zeros((1, 0), np.int32), max_new_tokens=2)


def test_pad_prompts():
  tokens, lengths = state_lib.pad_prompts([[5, 6, 7], [8]], pad_id=9, multiple=4)
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 9], [8, 9, 9, 9]])
  np.testing.assert_array_equal(lengths, [3, 1])


def test_decoding_fuses_projections_on_cpu_and_gives_the_same_tokens():
  from mtp.decode import speculative
  from mtp.decode import state as state_lib
  model = testing.tiny_model(0)
  prompts = testing.random_tokens((2, 5), 61, seed=4)
  assert state_lib.prepare(model).fused  # This suite runs on CPU.
  for generate in (autoregressive.generate, speculative.generate):
    fused, unfused = (generate(state_lib.prepare(model, fuse=fuse), prompts, max_new_tokens=12)
                      for fuse in (True, False))
    np.testing.assert_array_equal(fused.tokens, unfused.tokens)
