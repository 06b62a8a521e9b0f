"""The 'auto' decoder's loop: drafting stops when it does not pay, exact either way."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import driver
from mtp.decode import request as request_lib
from mtp.model import testing

VOCAB = 61
MAX_NEW = 24
DEPTH = 3
PROMPT_LENGTHS = np.array([7, 3, 5], np.int32)


@dataclasses.dataclass(frozen=True)
class KnownDrafts:
  """A chain hook: the reference continuation (right) or one off it (every draft wrong);
  `right_rows` (if given) are right and the other rows wrong."""
  right: bool
  right_rows: tuple[int, ...] | None = None

  def __call__(self, drafts, num_generated, data):
    index = num_generated[:, None] + jnp.arange(drafts.shape[1])[None, :]
    tokens = jnp.take_along_axis(data, index, axis=1)
    if self.right_rows is not None:
      right = np.isin(np.arange(drafts.shape[0]), self.right_rows)[:, None]
      return jnp.where(right, tokens, (tokens + 1) % VOCAB)
    return tokens if self.right else (tokens + 1) % VOCAB


@pytest.fixture(scope='module')
def model():
  return testing.tiny_model(0, mtp_num_heads=DEPTH)


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((3, 7), VOCAB, seed=1)


@pytest.fixture(scope='module')
def reference(model, prompts):
  return driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                         decoder='autoregressive')


def _run(model, prompts, reference, *, right, break_even, after=4, right_rows=None):
  ref = np.asarray(reference.tokens)
  data = jnp.asarray(np.pad(ref, ((0, 0), (0, DEPTH + 1))))
  return driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                         decoder='auto', draft_hook=KnownDrafts(right, right_rows),
                         hook_data=data, break_even=break_even, probe_steps=after)


def test_rejected_drafts_fall_back_to_one_token_steps_exactly(model, prompts, reference):
  out = _run(model, prompts, reference, right=False, break_even=1.5, after=4)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)
  # Every step emits one token (drafts all wrong), before and after the fallback.
  np.testing.assert_array_equal(out.num_steps, np.asarray(reference.num_generated) - 1)
  hist = np.asarray(out.accepted_histogram)
  assert hist.shape == (3, DEPTH + 2) and hist[:, 2:].sum() == 0


def test_drafts_that_pay_keep_drafting(model, prompts, reference):
  never = _run(model, prompts, reference, right=True, break_even=0.0)
  paying = _run(model, prompts, reference, right=True, break_even=3.5, after=2)
  np.testing.assert_array_equal(paying.tokens, reference.tokens)
  np.testing.assert_array_equal(paying.num_steps, never.num_steps)
  # Oracle drafts: DEPTH + 1 tokens per step until max_new_tokens cuts the last one.
  assert np.all(np.asarray(paying.num_steps) <= -(-(MAX_NEW - 1) // (DEPTH + 1)))


def test_a_high_break_even_stops_drafting_after_the_probe(model, prompts, reference):
  # Even oracle drafts (DEPTH + 1 = 4 tokens a step) fall short of 5 tokens a step.
  after = 2
  out = _run(model, prompts, reference, right=True, break_even=5.0, after=after)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  hist = np.asarray(out.accepted_histogram)
  np.testing.assert_array_equal(hist[:, DEPTH + 1], after)  # The probe's full steps.
  np.testing.assert_array_equal(hist[:, 1], MAX_NEW - 1 - after * (DEPTH + 1))


def test_a_batch_is_judged_by_its_row_furthest_behind(model, prompts, reference):
  # Rows 0 and 1 get oracle drafts (4 tokens a step), row 2 wrong ones (1): 3 tokens a
  # row-step on average, above the break-even of 2, but the batch runs until row 2 is done,
  # and for row 2 drafting costs 2 steps' time for 1 token. So drafting stops after the probe.
  after = 2
  out = _run(model, prompts, reference, right=True, break_even=2.0, after=after,
             right_rows=(0, 1))
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  hist = np.asarray(out.accepted_histogram)
  np.testing.assert_array_equal(hist[:2, DEPTH + 1], after)  # The probe's full steps only.
  np.testing.assert_array_equal(hist[2, 2:], 0)


def test_sampled_decoding_falls_back_too(model, prompts):
  kwargs = dict(max_new_tokens=MAX_NEW, temperature=1.0, rng=3)
  speculative = driver.generate(model, prompts, PROMPT_LENGTHS, decoder='speculative', **kwargs)
  never = driver.generate(model, prompts, PROMPT_LENGTHS, decoder='auto', break_even=0.0,
                          **kwargs)
  np.testing.assert_array_equal(never.tokens, speculative.tokens)
  out = driver.generate(model, prompts, PROMPT_LENGTHS, decoder='auto', break_even=100.0,
                        probe_steps=1, **kwargs)
  tokens = np.asarray(out.tokens)
  assert np.all((tokens >= 0) & (tokens < VOCAB))
  np.testing.assert_array_equal(out.num_generated, MAX_NEW)
  # One drafting step, then one token a step.
  assert np.all(np.asarray(out.num_steps) >= MAX_NEW - 1 - DEPTH)


def test_auto_without_heads_is_autoregressive(prompts):
  model = testing.tiny_model(0, mtp_num_heads=0)
  request = request_lib.make_request(model.cfg, 8, max_new_tokens=4, decoder='auto')
  assert not request.drafts and not request.fallback
  out = driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, decoder='auto')
  ref = driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                        decoder='autoregressive')
  np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_seconds_per_step_times_both_kinds_of_step(model, prompts):
  request = request_lib.make_request(model.cfg, prompts.shape[1], max_new_tokens=MAX_NEW,
                                     decoder='auto')
  times = {kind: driver.seconds_per_step(model, prompts, PROMPT_LENGTHS, request,
                                         drafting=kind, steps=4, repeats=1)
           for kind in (True, False)}
  assert all(0 < t < 10 for t in times.values()), times
  plain = request_lib.make_request(model.cfg, prompts.shape[1], max_new_tokens=MAX_NEW,
                                   decoder='speculative')
  with pytest.raises(ValueError, match='without fallback'):
    driver.seconds_per_step(model, prompts, PROMPT_LENGTHS, plain, drafting=False)


@pytest.mark.parametrize('break_even', [-1.0, float('nan'), float('inf'), True, (2.0, -1.0)])
def test_bad_break_even_is_named(model, prompts, break_even):
  with pytest.raises(ValueError, match='break_even must be'):
    driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=4, decoder='auto',
                    break_even=break_even)


def test_bad_probe_is_named(model, prompts):
  with pytest.raises(ValueError, match='probe_steps'):
    driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=4, decoder='auto',
                    break_even=2.0, probe_steps=0)


# Lookup on demand: an 'auto' tree with a lookup chain verifies the whole block only where every
# row's lookup drafts matched a long enough key, else the heads' block; each kind pays its way.

REPEATING = np.array([[5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 0, 0, 0, 0], [3, 4, 8, 1, 2, 0, 0]],
                     np.int32)


def _final_state(model, request, *, min_key, break_evens=(0.0, 0.0), probe_steps=2,
                 rows=(0, 1, 2)):
  """The loop state after decoding `rows` of REPEATING with `request` (internals: which kinds
  ran)."""
  rows = list(rows)
  prepared, state = driver._begin(model, REPEATING[rows], PROMPT_LENGTHS[rows], request, 0,
                                  None, 0, break_even=break_evens,
                                  probe_steps=probe_steps)
  state = state.replace(lookup_min_key=jnp.int32(min_key))
  return driver._run(prepared.structure, prepared.leaves, state,
                     jnp.int32(request.max_new_tokens), None, request)


@pytest.fixture(scope='module')
def lookup_request(model):
  return request_lib.make_request(model.cfg, REPEATING.shape[1], max_new_tokens=MAX_NEW,
                                  decoder='auto', tree=2, lookup=4)


@pytest.fixture(scope='module')
def repeating_reference(model):
  return driver.generate(model, REPEATING, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                         decoder='autoregressive')


@pytest.mark.parametrize('min_key', [0, 2, 99])
def test_lookup_on_demand_is_exact(model, lookup_request, repeating_reference, min_key):
  state = _final_state(model, lookup_request, min_key=min_key)
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens)
  steps = np.asarray(state.block_steps).sum(0)
  if min_key == 0:    # Every key qualifies: the whole block every step.
    assert steps[0] == 0 and steps[1] > 0
  elif min_key == 99:  # None does: the heads' block every step.
    assert steps[0] > 0 and steps[1] == 0
  assert steps.sum() == np.asarray(state.num_steps).sum()


def test_each_kind_of_step_stops_paying_on_its_own(model, lookup_request, repeating_reference):
  # The heads' block can never make 50 tokens a step: it stops after its probe; the whole
  # block (break-even 0) never stops, and runs wherever a lookup key qualifies.
  state = _final_state(model, lookup_request, min_key=0, break_evens=(50.0, 0.0))
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens)
  assert np.asarray(state.pays).tolist() == [True, True]  # min_key 0: heads never ran.
  state = _final_state(model, lookup_request, min_key=99, break_evens=(50.0, 0.0))
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens)
  assert np.asarray(state.pays).tolist() == [False, True]
  # The probe: 2 heads' steps for each of the 3 rows, then one token a step.
  assert np.asarray(state.block_steps).sum(0).tolist() == [2 * 3, 0]
  state = _final_state(model, lookup_request, min_key=0, break_evens=(0.0, 50.0))
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens)
  assert np.asarray(state.pays).tolist() == [True, False]
  assert np.asarray(state.block_steps).sum(0)[1] == 2 * 3


def test_lookup_stays_current_through_one_token_steps(model, lookup_request,
                                                      repeating_reference):
  # Heads stop after the probe; one-token steps follow; the whole block comes back wherever
  # the lookup drafts (kept current by the one-token steps) qualify.
  state = _final_state(model, lookup_request, min_key=2, break_evens=(50.0, 0.0))
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens)
  assert np.asarray(state.pays).tolist() == [False, True]
  assert np.asarray(state.block_steps).sum(0)[1] > 0
  # The last row repeats one token: alone in its batch (the whole block runs only where every
  # row's lookup key qualifies), its lookup drafts pass, many tokens a step.
  assert np.asarray(repeating_reference.tokens)[2].tolist() == [44] * MAX_NEW
  state = _final_state(model, lookup_request, min_key=2, break_evens=(50.0, 0.0), rows=[2])
  np.testing.assert_array_equal(state.tokens[:, :MAX_NEW], repeating_reference.tokens[2:])
  assert np.asarray(state.block_steps).sum(0)[1] > 0
  assert np.asarray(state.num_steps)[0] <= MAX_NEW // 3


def test_seconds_per_step_times_the_heads_block_alone(model, lookup_request):
  seconds = driver.seconds_per_step(model, REPEATING, PROMPT_LENGTHS, lookup_request,
                                    drafting=True, heads_only=True, steps=4, repeats=1)
  assert 0 < seconds < 10
  plain = request_lib.make_request(model.cfg, REPEATING.shape[1], max_new_tokens=MAX_NEW,
                                   decoder='auto', tree=2)
  with pytest.raises(ValueError, match='heads_only'):
    driver.seconds_per_step(model, REPEATING, PROMPT_LENGTHS, plain, drafting=True,
                            heads_only=True)


def _oracle_chain_of_one(model, prompts, max_new, **fallback):
  """'auto' with oracle drafts, one a step: a drafting step emits 2 tokens, a one-token step 1."""
  reference = driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=max_new,
                              decoder='autoregressive')
  data = jnp.asarray(np.pad(np.asarray(reference.tokens), ((0, 0), (0, 2))))
  out = driver.generate(model, prompts, PROMPT_LENGTHS, max_new_tokens=max_new, tree=1,
                        decoder='auto', draft_hook=KnownDrafts(True), hook_data=data,
                        **fallback)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  return np.asarray(out.accepted_histogram)[:, 2]  # Drafting steps per row.


def test_a_stopped_kind_is_tried_again_within_the_budget(model, prompts):
  # 2 tokens a step fall short of 2.2: drafting stops after its one-step probe. A failed retry
  # step would lose 2.2 - 1 = 1.2 one-token steps, half the 5% budget of 48: it is tried
  # again for one step after 48 one-token steps, and stops again.
  np.testing.assert_array_equal(
      _oracle_chain_of_one(model, prompts, 100, break_even=2.2, probe_steps=1), 2)
  # Without the retry's step (fewer one-token steps than 48 after the probe): the probe alone.
  np.testing.assert_array_equal(
      _oracle_chain_of_one(model, prompts, 40, break_even=2.2, probe_steps=1), 1)


def test_a_retry_probes_one_step_whatever_the_first_probe(model, prompts):
  np.testing.assert_array_equal(
      _oracle_chain_of_one(model, prompts, 100, break_even=2.2, probe_steps=3), 3 + 1)


def test_a_dynamic_tree_falls_back_exactly(model, prompts, reference):
  """'auto' with a dynamic tree: one kind of drafting step (the tree), stopped after the probe
  when it cannot reach its break-even, or kept at break-even 0; exact both ways."""
  request = request_lib.make_request(model.cfg, prompts.shape[1], max_new_tokens=MAX_NEW,
                                     decoder='auto', tree_budget=5)
  states = {}
  for break_even in (0.0, DEPTH + 2.0):  # DEPTH + 1 tokens a step at best: never reached.
    prepared, state = driver._begin(model, prompts, PROMPT_LENGTHS, request, 0, None, 0,
                                    break_even=break_even, probe_steps=2)
    states[break_even] = state = driver._run(prepared.structure, prepared.leaves, state,
                                             jnp.int32(10 ** 6), None, request)
    np.testing.assert_array_equal(driver.result(state, MAX_NEW).tokens, reference.tokens)
  kept, stopped = states[0.0], states[DEPTH + 2.0]
  np.testing.assert_array_equal(kept.block_steps[:, 0], kept.num_steps)
  assert np.all(np.asarray(stopped.block_steps[:, 0]) <= 2 + 2)  # The probe and a retry or two.
  assert np.all(np.asarray(stopped.num_steps) >= MAX_NEW - 1 - 4 * (DEPTH + 1))
