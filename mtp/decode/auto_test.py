"""The `auto` decoder: each row stops drafting where it does not pay, exactly; its
break-even, measured on the decoder's own loop and cached."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp
from mtp.decode import auto
from mtp.decode import calibration
from mtp.decode import engine as engine_lib
from mtp.decode import measurements
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.decode.drafters import lookup
from mtp.decode.drafters import shadow
from mtp.model import testing

VOCAB = 61
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


def _reference(model, prompts, max_new):
  return decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='autoregressive',
                               max_new_tokens=max_new)


def _run(model, prompts, max_new, *, right, break_even, right_rows=None, tree=None):
  reference = _reference(model, prompts, max_new)
  data = jnp.asarray(np.pad(reference.tokens, ((0, 0), (0, DEPTH + 1))))
  out = decode_testing.decode(
      model, prompts, PROMPT_LENGTHS, decoder='auto', max_new_tokens=max_new, lookup=0,
      tree=tree, draft_hook=KnownDrafts(right, right_rows), hook_data=data,
      break_even=break_even)
  np.testing.assert_array_equal(out.tokens, reference.tokens)  # Exact, whatever it drafted.
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)
  return np.asarray(out.accepted_histogram), out


def test_the_probe_keeps_the_worst_case_within_the_budget():
  budget = auto.FALLBACK_BUDGET / 2  # A plan of one kind: half for its probe.
  assert auto.probe_steps(0.9, 128) == auto.MOST_PROBE  # Drafting is free: the longest probe.
  assert auto.probe_steps(2.0, 128) == min(auto.MOST_PROBE, int(budget * 128 / 1.0))
  assert auto.probe_steps(3.4, 512) == int(budget * 512 / 2.4)
  # Where one failed step would lose more than the budget of a short completion: no probe.
  assert auto.probe_steps(30.0, 16) == 0
  assert auto.probe_steps(1.1, 1000) == auto.MOST_PROBE
  # Drafters whose drafts pass all or nothing get `least` steps, or none where the budget
  # cannot afford them.
  assert auto.probe_steps(2.0, 400, least=4) == int(budget * 400 / 1.0) >= 4
  assert auto.probe_steps(2.5, 128, least=4) == 0 < int(budget * 128 / 1.5)
  # A plan of two kinds shares the budget between them.
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1))
  state = policy.start(jnp.asarray([2.0, 2.0]), jnp.asarray([512]))
  assert np.asarray(state.probe).tolist() == [[int(budget / 2 * 512 / 1.0)] * 2]
  # Vectorized, as the loop calls it.
  np.testing.assert_array_equal(
      auto.probe_steps(jnp.asarray([0.9, 30.0]), jnp.asarray([128, 16])), [8, 0])


def test_rejected_drafts_fall_back_to_one_token_steps_exactly(model, prompts):
  max_new = 24
  hist, out = _run(model, prompts, max_new, right=False, break_even=1.5)
  # Every step emits one token (drafts all wrong), the probe's and the fallback's.
  np.testing.assert_array_equal(out.num_steps, np.asarray(out.num_generated) - 1)
  assert hist.shape == (3, DEPTH + 2) and hist[:, 2:].sum() == 0


def test_drafts_that_pay_keep_drafting(model, prompts):
  max_new = 64
  _, never = _run(model, prompts, max_new, right=True, break_even=0.0)
  hist, paying = _run(model, prompts, max_new, right=True, break_even=1.9)
  assert auto.probe_steps(1.9, max_new) >= 1
  np.testing.assert_array_equal(paying.num_steps, never.num_steps)
  # Oracle drafts: DEPTH + 1 tokens per step until the budget cuts the last one.
  assert np.all(np.asarray(paying.num_steps) <= -(-(max_new - 1) // (DEPTH + 1)))


def test_a_probe_that_would_cost_more_than_it_can_win_never_runs(model, prompts):
  hist, _ = _run(model, prompts, 24, right=True, break_even=5.0)
  assert auto.probe_steps(5.0, 24) == 0 and hist[:, 2:].sum() == 0


def test_a_batch_runs_the_kind_its_row_with_most_left_wants(model, prompts):
  # Rows 0 and 1 get oracle drafts (4 tokens a step), row 2 wrong ones (1): drafting pays for
  # rows 0 and 1, but the batch runs until row 2 is done, and for row 2 drafting costs 1.9
  # steps' time for 1 token. So after the probe the batch decodes one token a step, but for
  # row 2's one retry (after 60 one-token steps).
  max_new = 100
  probe = auto.probe_steps(1.9, max_new)
  wait = int(np.ceil(0.9 / (auto.FALLBACK_BUDGET / 2)))
  assert probe >= 1 and probe + wait + 1 < max_new - 1 < probe + 2 * wait + 2
  hist, _ = _run(model, prompts, max_new, right=True, break_even=1.9, right_rows=(0, 1))
  np.testing.assert_array_equal(hist[:2, DEPTH + 1], probe + 1)  # The probe's and the retry's.
  np.testing.assert_array_equal(hist[2, 2:], 0)


def _oracle_chain_of_one(model, prompts, max_new, break_even):
  """'auto' with oracle drafts, one a step: a drafting step emits 2 tokens, a one-token step 1;
  the drafting steps per row."""
  hist, _ = _run(model, prompts, max_new, right=True, break_even=break_even, tree=1)
  return hist[:, 2]


def test_a_stopped_kind_is_tried_again_within_the_budget(model, prompts):
  # 2 tokens a step fall short of 2.2: drafting stops after its probe. A failed retry step
  # loses 2.2 - 1 = 1.2 one-token steps, half the budget of 80 of them at 3%: it is tried again
  # for one step after 80 one-token steps, and stops again.
  probe = auto.probe_steps(2.2, 100)
  wait = int(np.ceil(1.2 / (auto.FALLBACK_BUDGET / 2)))
  assert 2 * probe + wait + 2 < 100 - 1 < 2 * probe + 2 * wait + 4  # Room for one retry.
  np.testing.assert_array_equal(_oracle_chain_of_one(model, prompts, 100, 2.2), probe + 1)
  np.testing.assert_array_equal(_oracle_chain_of_one(model, prompts, 40, 2.2),
                                auto.probe_steps(2.2, 40))  # No room for a retry.


def test_sampled_rows_draw_as_their_decoder_would(model, prompts):
  """A sampled row's draws follow its own account: never stopping (break-even 0) draws what
  speculative decoding draws, never drafting (out of reach) what autoregressive decoding does,
  with the same seeds."""
  kwargs = dict(max_new_tokens=24, temperature=1.0, seed=3)
  speculative = decode_testing.decode(model, prompts, PROMPT_LENGTHS, **kwargs)
  never = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='auto', lookup=0,
                                break_even=0.0, **kwargs)
  np.testing.assert_array_equal(never.tokens, speculative.tokens)
  ar = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='autoregressive',
                             **kwargs)
  stopped = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='auto', lookup=0,
                                  break_even=100.0, **kwargs)
  np.testing.assert_array_equal(stopped.tokens, ar.tokens)
  np.testing.assert_array_equal(stopped.accepted_histogram[:, 2:], 0)


def test_auto_without_heads_drafts_by_lookup_alone(prompts):
  model = testing.tiny_model(0, mtp_num_heads=0)
  engine = decode_testing.engine(model, 'auto', max_new_tokens=40)
  assert [type(d).__name__ for d in engine.plan.drafters] == ['LookupDrafter']
  ref = _reference(model, prompts, 40)
  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='auto', max_new_tokens=40)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert np.asarray(out.num_steps).sum() < np.asarray(ref.num_steps).sum()  # Copies passed.


# Lookup on demand: a plan of the heads' tree and a lookup chain verifies the whole block only
# where the deciding row's lookup drafts matched a long enough key, else the heads' block.

REPEATING = np.array([[5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 0, 0, 0, 0], [3, 4, 8, 1, 2, 0, 0]],
                     np.int32)


def test_lookup_drafts_are_ready_where_their_key_matched_enough_tokens():
  drafter = lookup.LookupDrafter(length=4, capacity=16)
  state = lookup.State(context=jnp.zeros((3, 20), jnp.int32), drafts=jnp.zeros((3, 4)),
                       key_length=jnp.asarray([0, lookup.MIN_KEY - 1, lookup.MIN_KEY]),
                       shadow=shadow.start(jnp.zeros((3, 4)), jnp.zeros((3,), bool)))
  assert np.asarray(drafter.ready(state)).tolist() == [False, False, True]


def test_the_step_kind_comes_from_the_rows_accounts():
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 4))
  state = policy.start(jnp.asarray([1.5, 2.0]), jnp.asarray([1024, 1024, 1024]))
  everyone = jnp.ones((3,), bool)
  greedy = jnp.asarray([True, True, False])
  ready = jnp.asarray([[True, True], [True, False], [True, True]])
  remaining = jnp.asarray([10, 50, 5])
  kind, row_kind = policy.choose(state, ready, everyone, greedy, remaining, jnp.int32(-1))
  # Row 1 decides among the greedy rows (most left): its lookup is not ready, so the heads'
  # kind; the sampled row 2 wants the whole block for itself, which the step then runs.
  assert int(kind) == 2 and np.asarray(row_kind).tolist() == [2, 2, 2]
  ready = ready.at[2, 1].set(False)
  kind, row_kind = policy.choose(state, ready, everyone, greedy, remaining, jnp.int32(-1))
  assert int(kind) == 1 and np.asarray(row_kind).tolist() == [1, 1, 1]
  kind, row_kind = policy.choose(state, ready, everyone, greedy, remaining, jnp.int32(0))
  assert int(kind) == 0 and np.asarray(row_kind).tolist() == [0, 0, 0]  # Forced: measuring.


def test_a_row_wants_the_kind_that_goes_furthest_against_its_cost_not_the_largest():
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1))
  costs = jnp.asarray([[1.5, 3.0]] * 3)
  ready = jnp.ones((3, 2), bool)
  state = policy.start(costs, jnp.asarray([1000] * 3))
  # Unjudged kinds rank first, the largest first: each is probed before it is compared.
  assert np.asarray(policy.wants(state, ready, costs)).tolist() == [2, 2, 2]
  # Judged: 3 tokens a step at 1.5 against 4 at 3.0 (both pay); row 1's kind 1 is still in
  # its probe; row 2's lookup is not ready.
  state = state.replace(tokens=jnp.asarray([[30, 40], [3, 40], [30, 40]]),
                        steps=jnp.asarray([[10, 10], [1, 10], [10, 10]]),
                        probe=jnp.asarray([[8, 4], [8, 4], [8, 4]]))
  ready = ready.at[2, 1].set(False)
  assert np.asarray(policy.wants(state, ready, costs)).tolist() == [1, 1, 1]
  assert np.asarray(policy.wants(state, jnp.ones((3, 2), bool), costs)).tolist() == [1, 1, 1]
  richer = state.replace(tokens=jnp.asarray([[30, 70], [30, 70], [30, 70]]),
                         steps=jnp.asarray([[10, 10]] * 3))  # 7 tokens a step at 3.0 goes further.
  assert np.asarray(policy.wants(richer, ready, costs)).tolist() == [2, 2, 1]
  # Without costs (or where a kind stopped paying) the largest kind that pays.
  assert np.asarray(policy.wants(state, ready, None)).tolist() == [2, 2, 1]
  stopped = state.replace(pays=jnp.asarray([[False, True], [False, False], [True, True]]))
  assert np.asarray(policy.wants(stopped, ready, costs)).tolist() == [2, 0, 1]


def test_a_kind_outranked_on_its_probe_is_wanted_again_where_its_evidence_says_more():
  """The block with lookup paid on its probe, but less against its cost than the heads' tree
  alone, so it never ran again and its account was never renewed; its drafter's evidence (its
  chains checked against the text) is, and where it says more the block is wanted again."""
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1), evidence_kinds=(False, True))
  costs = jnp.asarray([[1.1, 1.6]])
  ready = jnp.ones((1, 2), bool)
  state = policy.start(costs, jnp.asarray([128])).replace(
      tokens=jnp.asarray([[13, 10]]), steps=jnp.asarray([[10, 6]]), probe=jnp.asarray([[8, 1]]))
  assert np.asarray(state.pays).all()
  args = (ready, jnp.ones((1,), bool), jnp.ones((1,), bool), jnp.asarray([100]), jnp.int32(-1),
          costs)
  # 1.3 tokens a step at 1.1 goes further than 1.67 at 1.6.
  assert int(policy.wants(state, ready, costs)[0]) == 1
  assert int(policy.choose(state, *args)[0]) == 1
  # Evidence below the account changes nothing; lookup's chains matching 7 tokens a step do.
  weak = state.replace(evidence=jnp.asarray([[jnp.nan, 1.5]]))
  assert int(policy.choose(weak, *args)[0]) == 1
  repeating = state.replace(evidence=jnp.asarray([[jnp.nan, 7.0]]))
  assert int(policy.wants(repeating, ready, costs)[0]) == 2
  assert int(policy.choose(repeating, *args)[0]) == 2
  # In a batch the evidence counts for its row: two rows whose text repeats carry the block
  # for a third, (7 + 7 + 1.3) / (3 * 1.6) > 3.9 / 3.3, where their accounts alone would not.
  batch = jax.tree.map(lambda x: jnp.concatenate([x] * 3), repeating)
  batch = batch.replace(evidence=jnp.asarray([[jnp.nan, 7.0]] * 2 + [[jnp.nan, jnp.nan]]))
  ready3 = jnp.ones((3, 2), bool).at[2, 1].set(False)
  batch_args = (ready3, jnp.ones((3,), bool), jnp.ones((3,), bool), jnp.asarray([100, 90, 90]),
                jnp.int32(-1), jnp.concatenate([costs] * 3))
  assert int(policy.choose(batch, *batch_args)[0]) == 2
  stale = batch.replace(evidence=jnp.full((3, 2), jnp.nan))
  assert int(policy.choose(stale, *batch_args)[0]) == 1


def test_a_batch_runs_the_larger_block_only_where_the_batch_gains_from_it():
  """The row with most left wants the whole block (its lookup repeats: 8 tokens a step at 3.5);
  the others make the heads' 3 tokens a step either way, so they would pay 3.5 for 3 tokens
  where the heads' block costs them 1.8."""
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1))
  costs = jnp.asarray([[1.8, 3.5]] * 4)
  everyone, greedy = jnp.ones((4,), bool), jnp.ones((4,), bool)
  remaining = jnp.asarray([100, 90, 90, 90])
  ready = jnp.asarray([[True, True], [True, False], [True, False], [True, False]])
  state = policy.start(costs, jnp.asarray([128] * 4)).replace(
      pays=jnp.ones((4, 2), bool), tokens=jnp.asarray([[30, 80], [30, 30], [30, 30], [30, 30]]),
      steps=jnp.asarray([[10, 10]] * 4), probe=jnp.asarray([[8, 4]] * 4))
  assert np.asarray(policy.wants(state, ready, costs)).tolist() == [2, 1, 1, 1]
  args = (ready, everyone, greedy, remaining, jnp.int32(-1), costs)
  # (8 + 3 * 3) / (4 * 3.5) = 1.21 tokens per unit of cost, against 12 / 7.2 = 1.67.
  kind, row_kind = policy.choose(state, *args)
  assert int(kind) == 1 and np.asarray(row_kind).tolist() == [1, 1, 1, 1]
  # At batch 1 (the others done) the row's own choice stands.
  alone = jnp.asarray([True, False, False, False])
  assert int(policy.choose(state, ready, alone, greedy, remaining, jnp.int32(-1), costs)[0]) == 2
  # Where every row's text repeats, the whole block pays for the batch: (4 * 8) / 14 > 1.67.
  repeating = state.replace(tokens=jnp.asarray([[30, 80]] * 4))
  assert int(policy.choose(repeating, *args)[0]) == 2
  # A sampled row that wants the whole block keeps it: its tokens must not depend on others.
  sampled_wants = state.replace(tokens=state.tokens.at[3, 1].set(80))
  greedy_but_3 = jnp.asarray([True, True, True, False])
  kind, row_kind = policy.choose(sampled_wants, ready.at[3, 1].set(True), everyone,
                                 greedy_but_3, remaining, jnp.int32(-1), costs)
  assert int(kind) == 2 and np.asarray(row_kind).tolist() == [2, 2, 2, 2]
  # A whole block still in the deciding row's probe runs, so that it is judged at all.
  probing = state.replace(steps=jnp.asarray([[10, 2], [10, 10], [10, 10], [10, 10]]))
  assert int(policy.choose(probing, *args)[0]) == 2


def test_a_servers_batch_drafts_only_where_the_batch_gains():
  """Under `throughput` (continuous batching) the deciding greedy row's kind runs only where the
  batch's tokens per unit of cost beat the smallest step the sampled rows allow."""
  policy = auto.AutoPolicy(num_kinds=1, least_probe=(1,), throughput=True)
  offline = dataclasses.replace(policy, throughput=False)
  everyone = jnp.ones((3,), bool)
  ready = jnp.ones((3, 1), bool)
  remaining = jnp.asarray([50, 10, 10])
  costs = jnp.asarray([[2.0], [2.5]])  # Greedy rows', sampled rows' break-evens.
  mixed = jnp.asarray([True, False, False])
  greedy = jnp.ones((3,), bool)
  state = policy.start(policy.row_costs(costs, mixed), jnp.asarray([1024] * 3))
  # Row 0's heads pay for it (3 tokens a step against 2.0); rows 1 and 2 want none.
  state = state.replace(pays=jnp.asarray([[True], [False], [False]]),
                        tokens=jnp.asarray([[6], [0], [0]]), steps=jnp.asarray([[2], [0], [0]]))

  def choose(judge, greedy_rows, state=state):
    return judge.choose(state, ready, everyone, greedy_rows, remaining, jnp.int32(-1),
                        judge.row_costs(costs, greedy_rows))

  # Sampled rows 1 and 2 would pay the block for nothing: (3 + 1 + 1) / (2 + 2.5 + 2.5) < 1.
  assert int(choose(policy, mixed)[0]) == 0
  assert int(choose(offline, mixed)[0]) == 1
  # Greedy rows without an account of their own are neutral: (3 + 2 + 2) / 6 >= 1.
  assert int(choose(policy, greedy)[0]) == 1
  # A sampled row that wants the block sets the floor, whatever the batch gains.
  wanting = state.replace(pays=jnp.asarray([[False], [True], [False]]))
  kind, row_kind = choose(policy, mixed, wanting)
  assert int(kind) == 1 and np.asarray(row_kind).tolist() == [1, 1, 0]


def test_a_servers_sampled_rows_draft_only_where_they_pay_for_the_batch():
  """Under `throughput` a sampled row's kind runs for every row of the batch, so its drafts
  must pay for the whole block: 3 tokens a step pay against its break-even 2.5, not against
  1 + 3 x 1.5 = 5.5 at 3 rows. Greedy rows keep theirs; the block still costs what it does."""
  policy = auto.AutoPolicy(num_kinds=1, least_probe=(1,), throughput=True)
  offline = dataclasses.replace(policy, throughput=False)
  costs = jnp.asarray([[2.0], [2.5]])  # Greedy rows', sampled rows'.
  greedy = jnp.asarray([True, False, False])
  np.testing.assert_allclose(policy.row_costs(costs, greedy), [[2.0], [5.5], [5.5]])
  np.testing.assert_allclose(policy.block_costs(policy.row_costs(costs, greedy), greedy),
                             offline.row_costs(costs, greedy))
  for judge, sampled_row_drafts in ((offline, True), (policy, False)):
    rows = judge.row_costs(costs, greedy)
    state = judge.start(rows, jnp.asarray([100_000] * 3)).replace(
        pays=jnp.asarray([[False], [True], [False]]))
    for _ in range(auto.MOST_PROBE + 1):  # Row 1 makes 3 tokens in each step of the kind.
      state = judge.observe(state, rows, jnp.asarray([0, 1, 0]), jnp.asarray([1, 3, 1]),
                            jnp.ones((3,), jnp.int32))
    wants = np.asarray(judge.wants(state, jnp.ones((3, 1), bool), rows))
    assert wants.tolist() == [0, int(sampled_row_drafts), 0]


def test_each_kind_stops_paying_on_its_own_per_row():
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1))
  costs = jnp.asarray([2.0, 4.0])
  state = policy.start(costs, jnp.asarray([1000, 1000]))
  steps = jnp.ones((2,), jnp.int32)  # One step each.
  for _ in range(int(state.probe.max()) + 1):
    # Row 0 makes 3 tokens in heads' steps (pays); row 1 makes 3 in whole-block steps (short).
    state = policy.observe(state, costs, jnp.asarray([1, 2]), jnp.asarray([3, 3]), steps)
  assert np.asarray(state.pays).tolist() == [[True, True], [True, False]]


def test_sampled_rows_are_judged_on_their_own_break_even():
  """A sampled row's drafting step costs more (top-p sorts every node's distribution): the same
  3 tokens a step pay for a greedy row at break-even 2.2 and not for a sampled one at 3.4."""
  policy = auto.AutoPolicy(num_kinds=1, least_probe=(1,))
  costs = jnp.asarray([[2.2], [3.4]])  # Greedy rows', sampled rows'.
  greedy = jnp.asarray([True, False])
  rows = policy.row_costs(costs, greedy)
  np.testing.assert_allclose(rows, [[2.2], [3.4]])
  state = policy.start(rows, jnp.asarray([100_000, 100_000]))
  steps = jnp.ones((2,), jnp.int32)
  for _ in range(int(state.probe.max()) + 1):
    state = policy.observe(state, rows, jnp.asarray([1, 1]), jnp.asarray([3, 3]), steps)
  assert np.asarray(state.pays).tolist() == [[True], [False]]


def test_plans_measure_sampled_rows_break_even_unless_greedy_only(model, prompts, monkeypatch,
                                                                   tmp_path):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  measured = []

  def fake(engine, prompts, lengths, kind, *, sampled=False, **kwargs):
    measured.append((kind, sampled))
    return 2.0 + sampled
  monkeypatch.setattr(auto, 'break_even', fake)
  engine = plan_lib.resolve(model, 'auto', max_new_tokens=8, lookup=0)
  assert measured == [(1, False), (1, True)]
  assert np.asarray(engine.data.costs).tolist() == [[2.0], [3.0]]
  measured.clear()
  engine = plan_lib.resolve(model, 'auto', max_new_tokens=8, lookup=0, greedy_only=True)
  assert measured == [(1, False)] and np.asarray(engine.data.costs).tolist() == [[2.0], [2.0]]


@pytest.mark.parametrize('loop', ['as the curve', 'far above it', 'smaller far above too'])
def test_auto_prices_a_smaller_tree_on_the_loop_where_the_loop_prices_its_tree_far_above_the_curve(
    tiny_workdir, monkeypatch, tmp_path, loop):
  from mtp.decode import cost_model
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  accuracies = np.asarray([[0.5, 0.3, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]])
  monkeypatch.setattr(calibration, 'workdir_accuracies', lambda loaded: accuracies)
  curve = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.9}
  monkeypatch.setattr(cost_model, 'step_cost', lambda model, **kwargs: curve)
  loaded = mtp.load(tiny_workdir)
  chosen = cost_model.choose_tree(loaded.model, accuracies, cost=curve)
  smaller = cost_model.choose_tree(loaded.model, accuracies, cost=curve,
                                   candidates=range(2, chosen.num_nodes))
  assert chosen.num_nodes == 4 and smaller.num_nodes == 3
  priced = []

  def fake(engine, prompts, lengths, kind, *, sampled=False, **kwargs):
    nodes = engine.plan.drafters[0].tree.num_nodes
    priced.append((nodes, kind))
    if loop == 'as the curve' or (nodes == 3 and loop == 'far above it'):
      return {4: 1.15, 3: 1.08}[nodes] + 0.5 * (kind - 1)
    return 1.6 + 0.5 * (kind - 1)
  monkeypatch.setattr(auto, 'break_even', fake)
  engine = plan_lib.resolve(loaded, 'auto', max_new_tokens=16, greedy_only=True)
  heads_tree = engine.plan.drafters[0].tree
  if loop == 'far above it':  # 1.6 steps on the loop against the curve's 1.1.
    assert heads_tree == smaller
    assert priced == [(4, 1), (3, 1), (3, 1), (3, 2)]
    assert np.asarray(engine.data.costs)[0].tolist() == pytest.approx([1.08, 1.58])
  else:  # Where the loop agrees, or the smaller tree pays less on it, the curve's tree drafts.
    assert heads_tree == chosen
    assert priced == [(4, 1)] + [(3, 1)] * (loop != 'as the curve') + [(4, 1), (4, 2)]
  # A tree the caller names, or break-evens given, are never priced against the curve.
  priced.clear()
  plan_lib.resolve(loaded, 'auto', max_new_tokens=16, greedy_only=True, tree=chosen)
  plan_lib.resolve(loaded, 'auto', max_new_tokens=16, break_even=[2.0, 3.0])
  assert priced == [(4, 1), (4, 2)]


def test_a_kind_predicted_below_its_break_even_starts_stopped_and_above_it_probes(
    tiny_workdir):
  policy = auto.AutoPolicy(num_kinds=2, least_probe=(1, 1))
  costs, budgets = jnp.asarray([1.5, 1.5]), jnp.asarray([1000])
  state = policy.start(costs, budgets, jnp.asarray([1.2, jnp.inf]))
  assert np.asarray(state.pays).tolist() == [[False, True]]
  assert np.asarray(state.probe)[0, 1] == auto.probe_steps(1.5, 1000, budget=policy.share)
  # Predicted to pay, a kind pays even where the budget affords no probe, its account opened
  # with the prediction: a run of failed steps stops it, a few do not.
  short = jnp.asarray([16])
  assert auto.probe_steps(1.5, 16, budget=policy.share) == 0
  state = policy.start(costs, short, jnp.asarray([2.0, jnp.inf]))
  n = auto.PREDICTED_STEPS
  assert np.asarray(state.pays).tolist() == [[True, False]]
  assert np.asarray(state.steps).tolist() == [[n, 0]]
  assert np.asarray(state.tokens).tolist() == [[2 * n, 0]]
  # The prediction is of greedy acceptance: a sampled row's account opens empty.
  sampled = policy.start(costs, short, jnp.asarray([2.0, jnp.inf]), jnp.asarray([False]))
  assert not np.any(np.asarray(sampled.pays)) and not np.any(np.asarray(sampled.steps))
  one = jnp.ones((1,), jnp.int32)
  for failed in range(1, 3 * n):
    state = policy.observe(state, costs, one, one, one)  # Every draft rejected.
    if not state.pays[0, 0]:
      break
  assert failed == n + 1  # 2n + k tokens over n + k steps pay at 1.5 while k <= n.
  # The plan predicts the heads' tree's tokens per step from their measured accuracies; the
  # block with lookup beside it has no prediction.
  loaded = mtp.load(tiny_workdir)
  engine = plan_lib.resolve(loaded, 'auto', max_new_tokens=16, break_even=[1.0, 1.0])
  tree = engine.plan.drafters[0].tree
  predicted = 1 + trees.expected_accepted_length(tree, calibration.workdir_accuracies(loaded))
  expected = np.asarray(engine.data.expected)
  assert expected[0] == pytest.approx(predicted) and np.isinf(expected[1])


def test_one_token_steps_run_unjudged_until_a_deciding_row_could_want_a_kind():
  policy = auto.AutoPolicy(num_kinds=1, least_probe=(1,))
  costs = jnp.asarray([2.0])  # A failed retry loses 1 step: due after 1 / share steps idle.
  stopped = auto.State(pays=jnp.asarray([[False], [False]]), idle=jnp.asarray([[5], [30]]),
                       tokens=jnp.zeros((2, 1), jnp.int32), steps=jnp.zeros((2, 1), jnp.int32),
                       probe=jnp.ones((2, 1), jnp.int32),
                       evidence=jnp.full((2, 1), jnp.nan, jnp.float32))
  rows = (jnp.ones((2, 1), bool), jnp.ones((2,), bool), jnp.asarray([True, True]),
          jnp.asarray([40, 10]))
  due = int(np.ceil(1 / policy.share))
  # Row 0 decides (most left): one step short of its retry, which `observe` then fires.
  assert int(policy.quiet_steps(stopped, *rows, jnp.int32(-1), costs)) == due - 5 - 1
  # A sampled row decides too: the earlier retry bounds the run.
  sampled = (rows[0], rows[1], jnp.asarray([True, False]), rows[3])
  assert int(policy.quiet_steps(stopped, *sampled, jnp.int32(-1), costs)) == due - 30 - 1
  paying = stopped.replace(pays=jnp.asarray([[True], [False]]))
  assert int(policy.quiet_steps(paying, *rows, jnp.int32(-1), costs)) == 1
  assert int(policy.quiet_steps(paying, *rows, jnp.int32(0), costs)) > 10**6  # Measuring.
  # Where evidence could restart a stopped kind, runs are short enough to notice it.
  watching = dataclasses.replace(policy, evidence_kinds=(True,))
  assert int(watching.quiet_steps(stopped, *rows, jnp.int32(-1), costs)) == auto.EVIDENCE_QUIET


def test_evidence_restarts_a_stopped_kind_where_its_drafts_would_have_paid():
  policy = auto.AutoPolicy(num_kinds=1, least_probe=(1,))
  costs = jnp.asarray([2.0])
  state = policy.start(costs, jnp.asarray([100, 100]))
  # Both rows' probe fails: the kind stops for both.
  for _ in range(int(state.probe[0, 0])):
    state = policy.observe(state, costs, jnp.asarray([1, 1]), jnp.asarray([1, 1]),
                           jnp.asarray([1, 1]))
  assert not np.any(np.asarray(state.pays))
  # One-token steps; the drafter says row 0's drafts would have made 3 tokens a step.
  evidence = jnp.asarray([[3.0], [1.5]])
  state = policy.observe(state, costs, jnp.asarray([0, 0]), jnp.asarray([1, 1]),
                         jnp.asarray([1, 1]), evidence)
  np.testing.assert_array_equal(np.asarray(state.pays)[:, 0], [True, False])
  assert int(state.probe[0, 0]) == 1 and int(state.steps[0, 0]) == 0
  # Unknown evidence (NaN) never restarts anything.
  again = policy.observe(state, costs, jnp.asarray([0, 0]), jnp.asarray([1, 1]),
                         jnp.asarray([1, 1]), jnp.full((2, 1), jnp.nan))
  assert not bool(again.pays[1, 0])


@pytest.mark.parametrize('break_even', [(0.0, 0.0), (50.0, 0.0), (0.0, 50.0)])
def test_lookup_on_demand_is_exact(model, break_even):
  reference = _reference(model, REPEATING, 24)
  out = decode_testing.decode(model, REPEATING, PROMPT_LENGTHS, decoder='auto',
                              max_new_tokens=24, tree=2, lookup=4, break_even=break_even)
  np.testing.assert_array_equal(out.tokens, reference.tokens)


def test_seconds_per_step_times_each_kind_on_the_decoding_loop(model, prompts):
  engine = decode_testing.engine(model, 'auto', max_new_tokens=24, tree=2, lookup=4)
  compiled = None
  for kind in (0, 1, 2, 0):
    seconds = engine.seconds_per_step(prompts, PROMPT_LENGTHS, kind=kind, steps=4)
    assert 0 < seconds < 10
    assert 0 < engine.seconds_per_call(prompts, PROMPT_LENGTHS) < 10
    compiled = compiled or engine_lib.compilations()
  assert engine_lib.compilations() == compiled  # The kind is data: one compiled loop.
  # Timed from one prefilled state, which the timings copy and leave whole.
  prefilled = engine.timing_state(prompts, PROMPT_LENGTHS)
  for kind in (1, 0):
    assert 0 < engine.seconds_per_step(prompts, PROMPT_LENGTHS, kind=kind, steps=4,
                                       prefilled=prefilled) < 10
  assert 0 < engine.seconds_per_call(prompts, PROMPT_LENGTHS, prefilled=prefilled) < 10
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(prefilled))
  assert int(np.max(prefilled.num_steps)) == 0
  assert engine_lib.compilations() == compiled


def test_break_even_is_measured_once_then_read_from_the_cache(model, prompts, tmp_path,
                                                              monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  calls = []
  # Drafting steps cost 3 ms; one-token steps 2 ms, but a burst of load hits one of them; and a
  # call costs 16 ms whatever it runs, which the ratio must not count (else 64 / 48 ms).
  one_token = iter([0.002, 0.002, 0.006, 0.002, 0.002, 0.002] * 4)
  call = 0.016

  def per_step(self, prompts, lengths, *, kind, steps=16, overhead=0.0, sampled=False,
               prefilled=None):
    calls.append(kind)
    return ((0.003 if kind else next(one_token)) * steps + call - overhead) / steps

  def per_call(self, prompts, lengths, prefilled=None):
    calls.append('call')
    return call

  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_step', per_step)
  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_call', per_call)
  engine = decode_testing.engine(model, 'auto', max_new_tokens=12, lookup=0)
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  # One compiling pair, the calls' cost, then three pairs taking turns; the second call reads
  # the cache.
  assert calls == [1, 0] + ['call'] * 3 + [1, 0] * 3
  table = measurements.read_table('break_even.json')
  assert len(table) == 1 and len(next(iter(table.values()))['ratios']) == 3
  # A corrupt entry is measured again, not trusted.
  key = next(iter(table))
  measurements.store('break_even.json', key, {'break_even': 'fast'})
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  assert len(calls) == 22


def test_a_break_even_timed_under_load_is_measured_again_once_quiet(model, prompts, tmp_path,
                                                                   monkeypatch):
  """Fastest against fastest does not undo sustained load: such a break-even is used, and
  measured again by the first run that finds the machine quiet."""
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  timed, others = [], [1.0]  # Other processes' cores while timing.

  def per_step(self, prompts, lengths, *, kind, steps=16, overhead=0.0, sampled=False,
               prefilled=None):
    timed.append(kind)
    return (0.003 if kind else 0.002) * (1 + others[0])

  class Watch:

    def cores(self):
      return others[0]

  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_step', per_step)
  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_call',
                      lambda self, p, l, prefilled=None: 0.0)
  monkeypatch.setattr(measurements, 'OtherWork', Watch)
  engine = decode_testing.engine(model, 'auto', max_new_tokens=12, lookup=0)
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  [entry] = measurements.read_table('break_even.json').values()
  assert entry[measurements.OTHERS_CORES] == 1.0
  runs = len(timed)
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  assert len(timed) == runs  # Still busy (conftest): read from the cache.
  monkeypatch.setattr(measurements, 'machine_quiet', lambda: True)
  others[0] = 0.0
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  assert len(timed) == 2 * runs
  [entry] = measurements.read_table('break_even.json').values()
  assert entry[measurements.OTHERS_CORES] == 0.0
  assert auto.break_even(engine, prompts, PROMPT_LENGTHS, 1) == pytest.approx(1.5)
  assert len(timed) == 2 * runs  # Timed on a quiet machine: kept.


def test_steps_cheaper_than_a_calls_noise_are_timed_with_it(model, prompts, tmp_path,
                                                            monkeypatch):
  """Where a run's steps cost less than the variation of a call's overhead (a tiny model),
  taking the overhead off leaves nothing: the ratio of whole runs is read instead."""
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))

  def per_step(self, prompts, lengths, *, kind, steps=16, overhead=0.0, sampled=False,
               prefilled=None):
    return max((0.0003 if kind else 0.0001) * steps + 0.010 - overhead, 0.0) / steps

  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_step', per_step)
  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_call',
                      lambda self, p, l, prefilled=None: 0.020)
  engine = decode_testing.engine(model, 'auto', max_new_tokens=12, lookup=0)
  ratio = auto.break_even(engine, prompts, PROMPT_LENGTHS, 1, steps=4, repeats=2)
  assert ratio == pytest.approx((0.0012 + 0.010) / (0.0004 + 0.010))


def test_the_real_measurement_is_a_positive_ratio(model, prompts, tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  engine = decode_testing.engine(model, 'auto', max_new_tokens=12, lookup=0)
  prefills = []
  prefill = engine_lib.Engine.prefill
  monkeypatch.setattr(engine_lib.Engine, 'prefill',
                      lambda self, *a, **k: prefills.append(1) or prefill(self, *a, **k))
  ratio = auto.break_even(engine, prompts, PROMPT_LENGTHS, 1, steps=4, repeats=2)
  assert 0 < ratio < 100
  assert len(prefills) == 1  # Every timed run starts from a copy of one prefilled state.


def test_resolving_auto_measures_each_kind(model, prompts, tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  from mtp.decode import plan
  engine = plan.resolve(model, 'auto', max_new_tokens=12, tree=2, lookup=4,
                        calibration=(prompts, PROMPT_LENGTHS))
  costs = np.asarray(engine.data.costs)
  assert costs.shape == (2, 2) and np.all(costs > 0)  # Greedy rows' and sampled rows'.
  assert len(measurements.read_table('break_even.json')) == 4
  rows = engine.settings([settings_lib.Sampling(max_tokens=12)] * 3)
  out = engine.generate(prompts, PROMPT_LENGTHS, rows)
  np.testing.assert_array_equal(out.tokens, _reference(model, prompts, 12).tokens)


def test_a_stopped_lookup_restarts_where_the_text_shows_its_drafts_would_pay(prompts):
  """Lookup at a break-even of 2 cannot afford a probe in 64 tokens, and its wait for a retry
  outlasts them: only its evidence (its chains checked against the text) restarts it."""
  model = testing.tiny_model(0, mtp_num_heads=0)
  ref = _reference(model, prompts, 64)
  assert auto.probe_steps(2.0, 64, auto.ALL_OR_NOTHING_LEAST_PROBE,
                          auto.FALLBACK_BUDGET / 2) == 0
  assert 1 / (auto.FALLBACK_BUDGET / 2) > 64  # The wait for a retry.
  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='auto', max_new_tokens=64,
                              break_even=2.0)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert np.asarray(out.accepted_histogram)[:, 3:].sum() > 0  # Copies passed.
  assert np.asarray(out.num_steps).sum() < np.asarray(ref.num_steps).sum()


def test_a_break_even_serves_shapes_within_a_factor_of_two(model, tmp_path, monkeypatch):
  """Each new prompt width had measured again (15 s per `mtp.generate` call on SmolLM2): widths
  (up to 64 tokens, then within a factor of two), timed steps and caches within a factor of two
  share a break-even; a wider prompt, fewer new tokens or another batch measure their own."""
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  timed = []

  def per_step(self, prompts, lengths, *, kind, steps=16, overhead=0.0, sampled=False,
               prefilled=None):
    timed.append(np.shape(prompts))
    return 0.003 if kind else 0.002

  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_step', per_step)
  monkeypatch.setattr(engine_lib.Engine, 'seconds_per_call',
                      lambda self, p, l, prefilled=None: 0.0)
  monkeypatch.setattr(engine_lib.Engine, 'timing_state', lambda self, *a, **k: None)

  def measures(width: int, max_new_tokens: int, batch_size: int = 1) -> bool:
    engine = decode_testing.engine(model, 'auto', max_new_tokens=max_new_tokens, lookup=0,
                                   prompt_width=width, batch_size=batch_size)
    prompts = np.ones((batch_size, width), np.int32)
    before = len(timed)
    auto.break_even(engine, prompts, np.full((batch_size,), width), 1, steps=16)
    return len(timed) > before

  assert measures(5, 20)
  assert not measures(7, 24)  # Widths 5 and 7, 20 and 24 tokens: one break-even.
  assert not measures(40, 24)  # Prompts within one prefill chunk.
  assert measures(100, 24)
  assert measures(5, 6)  # Runs of 6 steps, not 16.
  assert measures(5, 20, batch_size=2)
