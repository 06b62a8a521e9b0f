"""The `auto` decoder: speculative decoding that judges, row by row, whether drafting pays.

A drafting step of kind k verifies a block of the plan's first k drafters (the heads' tree,
then their tree with prompt lookup's chain beside it). It pays for a row when the row emits
more tokens per such step than the step costs in one-token steps: its break-even, measured
once per hardware, model shape, batch size and block on the very compiled loop that decodes
(`break_even`), fastest run against fastest run.

Each row keeps its own account (`State`): the tokens it emitted in steps of each kind and the
steps it took. A kind starts paying for a row, is checked after a probe of a few steps, stops
where the row's tokens per step fall below the break-even, and is tried again for one step once
enough steps have passed that a failed retry loses at most its share of the budget of them,
or at once where its newest drafter's evidence says its drafts would have paid since (prompt
lookup checks its chains against the text it did not verify: `Drafter.evidence`).
Where every draft fails, the probes and the retries of all kinds together lose at most
`FALLBACK_BUDGET` of the row's one-token steps: each kind's probe at most its half of the
kind's share of the row's token budget, its retries at most the other half of the steps since.
A probe the budget cannot afford does not run (the kind starts stopped; its retries sample it
later): in a short completion it could not win back what it costs. The plan's prediction
overrides the budget both ways: a kind whose tokens per step, predicted from the heads'
measured accuracies, fall below its break-even starts stopped; one predicted to pay starts
paying, the prediction counted as a few steps of its account. Of the kinds that pay for
it and whose newest drafter is `ready` (prompt lookup: its key matched at least two tokens), a
row wants the one whose tokens per step go furthest against its break-even, each judged on its
own probe first, the largest first, and later on its account or, where that says more, its
newest drafter's evidence (`AutoPolicy.wants`).

A step is one kind for the whole batch (one compiled block), and a batch runs until its last
row is done, so the kind is the one wanted by the row with the most tokens left to make, or a
smaller block where that gives the batch more tokens per unit of cost once that row has judged
its kind (a larger block is paid by every row, for drafts that may pay for one:
`_batch_block`); every greedy row verifies that step's drafts (free for it, and exact). A
sampled row verifies only the drafts of the kind it wants itself, and a step is never smaller
than what a sampled row wants: which tokens a sampled row draws then depends on its own account
alone, not on its neighbours (`settings`). Rows joining a running batch start their own
account. A server's batch never ends (rows leave and others join: `AutoPolicy.throughput`):
there that row's kind runs only where the batch's tokens per unit of cost, each row's from its
own account, are at least those of the smallest step the sampled rows allow; else sampled rows
that do not verify its drafts paid for its block (the demo model's server, mixed settings:
`auto` at 0.46x plain decoding, now 0.83x). And since a sampled row's kind runs for every row,
there a sampled row judges its kinds on what pays for the whole batch's block
(`AutoPolicy.row_costs`): SmolLM2's server at 8 rows under mixed settings, 0.79x plain decoding
judged on its own break-even, 0.97x so.

Measured: see `break_even`; the README has the figures.
"""

from __future__ import annotations

import dataclasses
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtp.decode import buckets
from mtp.decode import cost_model
from mtp.decode import measurements

Array = jax.Array
# What a row may lose to one-token decoding in the worst case, where every draft fails: its
# probes and retries of every kind of drafting together are sized to lose at most this fraction
# of its one-token steps: 3%, so that `auto` keeps at least 0.97x plain decoding's speed where
# nothing pays. (5% per kind, probe and retries each, read 0.93-0.95x at batch 8 on validation
# code, where a batch's deciding row's failed probes are paid by every row.)
FALLBACK_BUDGET = 0.03
# Most probe steps (acceptance is noisy over fewer, and more only delays the judgement).
MOST_PROBE = 8
# The fewest probe steps of drafters whose drafts pass all or nothing (prompt lookup): judged on
# fewer, lookup on the demo model's validation-split code (which pays, 6 tokens a step) was
# mostly stopped by its first unlucky step. Where the budget cannot afford as many, no probe.
ALL_OR_NOTHING_LEAST_PROBE = 4
# The weight, in steps, of the tokens per step the plan predicts for a kind (`AutoPolicy.start`).
PREDICTED_STEPS = 8
# Most one-token steps run unjudged while a stopped kind's evidence could restart it.
EVIDENCE_QUIET = 8
_TABLE = 'break_even.json'
# Bumped when the way break-evens are timed changes (a change in what steps cost bumps
# `cost_model.STEPS_VERSION`), so that older measurements are not reused. 14: a branching
# block reads Attention's own keys, rounded by `kv_cache.rounded`, and mapped rows no longer
# copy their cache in its step (12 read them with their rounding left to a conversion). 15:
# sampled rows' steps shape only the nodes they reach and draw by inverse CDF (`sampling`).
_LOOP_VERSION = 15


@flax.struct.dataclass
class State:
  """Every row's account of each kind of drafting step ([B, K] each, kind k + 1 in column k).

  Attributes:
    pays: whether the kind still pays for the row.
    idle: the row's steps since the kind stopped (0 while it pays).
    tokens: tokens the row emitted in steps of the kind (since its last retry; at first, for
      a kind predicted to pay, also its prediction's, as `PREDICTED_STEPS` steps).
    steps: steps of the kind that worked on the row (since its last retry; the same).
    probe: steps of the kind before it is first checked.
    evidence: the tokens per step the kind's newest drafter says its drafts would have made
      in recent steps, judged from the text (NaN: it cannot tell; `Drafter.evidence`).
  """
  pays: Array
  idle: Array
  tokens: Array
  steps: Array
  probe: Array
  evidence: Array


def probe_steps(break_even, max_tokens, least=1, budget: float = FALLBACK_BUDGET / 2):
  """Drafting steps before the first check, so that their worst case costs at most `budget`
  of `max_tokens` one-token steps (numpy or jnp, broadcasting).

  A probe step whose drafts all fail emits one token at `break_even` one-token steps: it loses
  break_even - 1. As many steps as the budget affords, at most `MOST_PROBE`; none (0: the kind
  starts stopped) where it affords fewer than `least` (a kind whose steps accept all or nothing,
  prompt lookup, is judged on fewer steps only by luck).
  """
  xp = jnp if isinstance(break_even, jax.Array) or isinstance(max_tokens, jax.Array) else np
  loss = xp.maximum(xp.asarray(break_even, xp.float32) - 1, 1e-6)
  affordable = xp.floor(budget * xp.asarray(max_tokens, xp.float32) / loss)
  probe = xp.minimum(affordable, MOST_PROBE)
  free = xp.asarray(break_even) <= 1  # Drafting costs no more than a one-token step.
  return xp.where(free, MOST_PROBE, xp.where(affordable >= least, probe, 0)).astype(xp.int32)


def _deciding(active: Array, greedy: Array, remaining: Array) -> Array:
  """[B] the rows whose wants decide a step's kind: the greedy row with the most tokens left
  (the batch runs until it is done) and every sampled row."""
  first = jnp.argmax(jnp.where(active & greedy, remaining, -1))
  return active & (~greedy | (jnp.arange(active.shape[0]) == first) & greedy)


def _batch_value(state: State, costs: Array, active: Array, greedy: Array, wants: Array,
                 kind: Array) -> Array:
  """[] the batch's expected tokens per unit of cost in a step of `kind`: each active row's
  tokens per step of the kind it would verify (`_rates`; its break-even where it has no
  account, which makes a row without data neutral), over what the block costs the rows (a
  sampled row that verifies less still runs the whole block)."""
  row_kind = jnp.where(greedy, kind, jnp.minimum(wants, kind))
  column = jnp.maximum(row_kind - 1, 0)[:, None]
  # Without an account a row is neutral (its break-even) unless its evidence says more.
  rates = jnp.where(state.steps > 0, _rates(state), jnp.fmax(costs, state.evidence))
  rate = jnp.where(row_kind > 0, jnp.take_along_axis(rates, column, axis=1)[:, 0], 1.0)
  cost = jnp.where(kind > 0, costs[:, jnp.maximum(kind - 1, 0)], 1.0)
  return jnp.sum(jnp.where(active, rate, 0)) / jnp.maximum(jnp.sum(jnp.where(active, cost, 0)),
                                                          1e-6)


def _rates(state: State) -> Array:
  """[B, K] each row's tokens per step of each kind: its account's, or its newest drafter's
  evidence where that says more (NaN: neither).

  A kind's block verifies its newest drafter's chain, so it makes at least the tokens the
  evidence says that chain would have made. And the account of a kind that pays but ranks
  below another is never renewed: SmolLM2's demo drafter on a held-out file probed the block
  with lookup where lookup missed (10 tokens in 6 steps at a break-even of 1.57, against 1.3
  a step for the heads' tree alone at 1.11), then ran the heads alone for 96 steps while
  lookup's evidence read 7 tokens a step: 1.25 tokens a step in all, 2.06 judged on the
  evidence too."""
  account = jnp.where(state.steps > 0, state.tokens / jnp.maximum(state.steps, 1), jnp.nan)
  return jnp.fmax(account.astype(jnp.float32), state.evidence)


def _unjudged(state: State) -> Array:
  """[B, K] the kinds each row has not judged yet: still in their probe, or never run."""
  return (state.steps < state.probe) | (state.steps == 0)


def _batch_block(state: State, costs: Array, active: Array, greedy: Array, wants: Array,
                 deciding: Array, kind: Array, floor: Array) -> Array:
  """[] the drafting kind of 1..kind (kind > 0: the deciding rows' choice) that gives the batch
  the most tokens per unit of cost (`_batch_value`; ties: the larger), once every deciding row
  that wants `kind` has judged it (a kind in its probe runs, or it would never be judged), and
  never smaller than `floor`, the largest kind a sampled row wants (its tokens must not depend
  on its neighbours).

  A larger kind's block is a superset of a smaller one's, and every row pays for it: lookup's
  chain beside the heads' tree pays for the row whose text repeats, while the others pay its
  cost for their heads' drafts alone (SmolLM2's drafter at batch 4 on held-out code, bfloat16:
  the whole block's break-even 3.50 against the tree's 1.79; `auto` 1.32x its autoregressive
  decoding, the heads' chain alone 1.42x). At batch 1 the choice is the row's own."""
  k = costs.shape[1]
  unjudged = _unjudged(state)[:, jnp.maximum(kind - 1, 0)]
  settled = jnp.all(~(deciding & (wants == kind) & unjudged))
  values = jnp.stack([_batch_value(state, costs, active, greedy, wants, jnp.int32(j))
                      for j in range(1, k + 1)])
  kinds = jnp.arange(1, k + 1)
  values = jnp.where((kinds <= kind) & (kinds >= floor), values, -jnp.inf)
  best = k - jnp.argmax(values[::-1])  # The largest of the best.
  return jnp.where((kind > 1) & settled, best, kind).astype(kind.dtype)


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
  """The policy of a plan with `num_kinds` kinds of drafting step.

  least_probe: per kind, the fewest probe steps it is judged on (see `probe_steps`).
  budget: what every kind's probes and retries together may lose (see the module's docstring).
  evidence_kinds: per kind, whether its newest drafter gives evidence (`Drafter.evidence`).
  throughput: choose each step for the batch's tokens per unit of cost (continuous batching,
    where every row's progress counts) rather than for the row with the most tokens left (a
    batch decoded to its end, whose time that row sets).
  """
  num_kinds: int
  least_probe: tuple[int, ...]
  budget: float = FALLBACK_BUDGET
  evidence_kinds: tuple[bool, ...] = ()
  throughput: bool = False

  @property
  def share(self) -> float:
    """What one kind's probe, and separately its retries, may lose."""
    return self.budget / (2 * self.num_kinds)

  def row_costs(self, costs: Array, greedy: Array) -> Array:
    """[B, K] what each row's drafts must make a step to pay: costs [2, K] (greedy rows',
    sampled rows' break-evens) by greedy [B].

    Under `throughput` a sampled row's kind runs for the whole batch (a step is never smaller
    than what a sampled row wants), so its drafts must pay for every row's share of the block:
    1 + B (c - 1) for the batch's B rows. B is the batch's size, not how many rows run now, so
    that its tokens still depend on its own account alone. (Judged on its own break-even, a
    server's sampled rows made `auto` serve 0.79x plain decoding at 8 rows under mixed
    settings: 89 ms a step against 53 for 1.44 tokens; with no floor at all, 1.01x.)"""
    rows = costs[jnp.where(greedy, 0, 1)]
    if not self.throughput:
      return rows
    return jnp.where(greedy[:, None], rows, 1 + greedy.shape[0] * (rows - 1))

  def block_costs(self, row_costs: Array, greedy: Array) -> Array:
    """[B, K] what each kind's block costs the rows, in one-token steps, from `row_costs`."""
    if not self.throughput:
      return row_costs
    return jnp.where(greedy[:, None], row_costs, 1 + (row_costs - 1) / greedy.shape[0])

  def start_rows(self, data, settings) -> State:
    """Fresh accounts for rows with these `settings.RowSettings`, from the `plan.PlanData`."""
    greedy = settings.temperature == 0
    return self.start(self.row_costs(data.costs, greedy), settings.max_tokens, data.expected,
                      greedy)

  def start(self, costs: Array, max_tokens: Array, expected: Array | None = None,
            greedy: Array | None = None) -> State:
    """Fresh accounts for rows with budgets `max_tokens` [B]; costs: [B, K] (or [K]) the rows'
    break-evens (`row_costs`); expected: [K] tokens per step predicted (inf: unknown): a kind
    predicted below its break-even starts stopped (its retries still sample it); one predicted
    at or above it starts paying whatever the budget affords, its account opened with
    `PREDICTED_STEPS` steps at the predicted rate, so that a few unlucky steps do not stop it
    and a row where it truly fails stops it within about as many more. The prediction is of
    greedy acceptance: given `greedy` [B], sampled rows' accounts open empty."""
    b = max_tokens.shape[0]
    probe = probe_steps(costs, max_tokens[:, None],
                        jnp.asarray(self.least_probe, jnp.int32)[None, :], self.share)
    tokens = steps = jnp.zeros((b, self.num_kinds), jnp.int32)
    if expected is not None:
      predicted = jnp.isfinite(expected)[None, :]
      probe = jnp.where(predicted & (expected[None, :] < costs), 0, probe)
      # The budget bounds what drafts of unknown worth may lose; these are predicted to win.
      # (SmolLM2's drafter at batch 4: a break-even of 2.1, where 128 tokens afforded no
      # probe, or where the 8-step probe of the row that decides fell short on a docstring's
      # first lines, so `auto` barely drafted while its tree alone made 3.5 tokens a step.)
      rows = jnp.ones((b, 1), bool) if greedy is None else greedy[:, None]
      wins = predicted & (expected[None, :] >= costs) & rows
      steps = jnp.where(wins, PREDICTED_STEPS, 0).astype(jnp.int32)
      tokens = jnp.where(wins, jnp.floor(expected[None, :] * PREDICTED_STEPS), 0
                         ).astype(jnp.int32)
      probe = jnp.where(wins, PREDICTED_STEPS + 1, probe)  # Judged from its first real step.
    return State(pays=probe > 0, idle=jnp.zeros((b, self.num_kinds), jnp.int32), tokens=tokens,
                 steps=steps, probe=probe,
                 evidence=jnp.full((b, self.num_kinds), jnp.nan, jnp.float32))

  def wants(self, state: State, ready: Array, costs: Array | None = None) -> Array:
    """[B] the kind each row wants (0: none): of the kinds that pay for it and are ready, the
    one whose tokens per step (`_rates`: its account, or its drafter's evidence where that says
    more) go furthest against its break-even (`costs` [B, K]), not the largest: a block with
    lookup beside the heads' tree may pay and still pay less than the tree alone, most at
    larger batches. A kind still in its probe ranks first, the largest first, so each is judged
    on its own steps before it is compared (as is every kind when `costs` is None)."""
    eligible = state.pays & ready  # [B, K]
    unjudged = _unjudged(state)
    if costs is None:
      value = jnp.full(eligible.shape, jnp.inf)
    else:
      value = jnp.where(unjudged, jnp.inf,
                        jnp.nan_to_num(_rates(state), nan=0.0) / jnp.maximum(costs, 1e-6))
    value = jnp.where(eligible, value, -jnp.inf)
    best = self.num_kinds - jnp.argmax(value[:, ::-1], axis=1)  # The largest of the best.
    return jnp.where(jnp.any(eligible, axis=1), best, 0).astype(jnp.int32)

  def choose(self, state: State, ready: Array, active: Array, greedy: Array,
             remaining: Array, force: Array, costs: Array | None = None
             ) -> tuple[Array, Array]:
    """The step's kind and each row's.

    Args:
      state: the rows' accounts.
      ready: [B, K] whether kind k + 1's newest drafter is ready for the row.
      active: [B] rows still decoding.
      greedy: [B] greedy rows.
      remaining: [B] tokens each row still may make.
      force: [] a kind to run whatever the accounts say (-1: none; measurements).
      costs: [B, K] the rows' break-evens (`row_costs`; needed under `throughput`; without
        them each row wants its largest kind that pays).

    Returns:
      (kind [] in 0..K, row_kind [B]: the kind whose drafts each row verifies).
    """
    wants = self.wants(state, ready, costs)
    deciding = _deciding(active, greedy, remaining)
    kind = jnp.max(jnp.where(deciding, wants, 0))
    floor = jnp.max(jnp.where(active & ~greedy, wants, 0))  # The smallest step sampled rows allow.
    block = None if costs is None else self.block_costs(costs, greedy)
    if costs is not None and self.num_kinds > 1:
      kind = _batch_block(state, block, active, greedy, wants, deciding, kind, floor)
    if self.throughput:
      # The sampled rows' floor, unless the decider's kind pays for the batch.
      value = lambda k: _batch_value(state, block, active, greedy, wants, k)  # noqa: E731
      kind = jnp.where(value(kind) >= value(floor), kind, floor)
    kind = jnp.where(force >= 0, force, kind)
    row_kind = jnp.where(greedy | (force >= 0), kind, jnp.minimum(wants, kind))
    return kind.astype(jnp.int32), row_kind.astype(jnp.int32)

  def quiet_steps(self, state: State, ready: Array, active: Array, greedy: Array,
                  remaining: Array, force: Array, costs: Array) -> Array:
    """[] >= 1: one-token steps that a step of kind 0 certainly stands for (the loop runs them
    without judging each): 1 where a row whose wants decide has a kind that pays (its drafter
    may be ready next step), else until one step before such a row's first retry (`observe`
    fires it on time whatever float rounding does), at most `EVIDENCE_QUIET` where a stopped
    kind's evidence may restart it; every step under `force`."""
    del ready
    deciding = _deciding(active, greedy, remaining)[:, None]
    due = jnp.ceil(jnp.maximum(costs - 1, 0) / self.share) - state.idle - 1
    if any(self.evidence_kinds):
      watched = jnp.asarray(self.evidence_kinds)[None, :]
      due = jnp.where(watched, jnp.minimum(due, EVIDENCE_QUIET), due)
    quiet = jnp.min(jnp.where(deciding & ~state.pays, due, 2**30))
    quiet = jnp.where(jnp.any(deciding & state.pays), 1, jnp.maximum(quiet, 1))
    return jnp.where(force >= 0, 2**30, quiet).astype(jnp.int32)

  def observe(self, state: State, costs: Array, row_kind: Array, emitted: Array,
              steps_taken: Array, evidence: Array | None = None) -> State:
    """The accounts after a step in which each row verified the drafts of `row_kind` [B] (0:
    none; then possibly several one-token steps) over `steps_taken` [B] steps (0: finished) and
    emitted `emitted` [B] tokens; `evidence` [B, K]: each kind's newest drafter's (NaN: none).
    Then each row's judgement: a stopped kind is retried when its wait is over or where its
    evidence reaches the break-even. costs: [B, K] (or [K]) the rows' break-evens."""
    active = steps_taken > 0
    counted = active[:, None] & (jnp.arange(1, self.num_kinds + 1)[None, :] == row_kind[:, None])
    tokens = state.tokens + jnp.where(counted, emitted[:, None], 0)
    steps = state.steps + counted.astype(jnp.int32)
    early = steps < state.probe
    pays = state.pays & (early | (tokens.astype(jnp.float32)
                                  >= costs * steps.astype(jnp.float32)))
    idle = jnp.where(pays, 0, state.idle + steps_taken[:, None])
    failed_retry = jnp.maximum(costs - 1, 0)  # One step whose drafts all fail.
    if evidence is None:
      evidence = state.evidence
    retry = ~pays & ((idle.astype(jnp.float32) * self.share >= failed_retry)
                     | (evidence >= costs))
    keep = active[:, None]
    return State(pays=jnp.where(keep, pays | retry, state.pays),
                 idle=jnp.where(keep, jnp.where(retry, 0, idle), state.idle),
                 tokens=jnp.where(keep & ~retry, tokens, jnp.where(keep, 0, state.tokens)),
                 steps=jnp.where(keep & ~retry, steps, jnp.where(keep, 0, state.steps)),
                 probe=jnp.where(keep & retry, 1, state.probe),
                 evidence=jnp.where(keep, evidence, state.evidence))


# ------------------------------------------------------------------------------------------
# Measuring the break-even.
# ------------------------------------------------------------------------------------------


# Row-steps a timed run of `break_even` takes by default. Mapped rows cost a step each (8 of them
# took 43 s of the server's 62 s warm-up for the notebooks' tiny model when each of 8 rows ran
# 64 steps); a shared batch's step costs about one row's.
ROW_STEPS = 64


def _cache_key(engine, batch_size: int, prompt_width: int, kind: int, sampled: bool,
               steps: int) -> str:
  """The break-even's key. Prompt widths, timed steps (capped by the plan's new tokens) and cache
  capacities within a factor of two share one, and so do prompts of up to 64 tokens: SmolLM2's
  demo drafter at batch 1 read its two kinds within 5% of each other across 5- to 655-token
  prompts, 16 to 128 new tokens and 128 to 896 slots, and each new width had cost every
  `mtp.generate` call 15 s of measuring."""
  plan = engine.plan
  block, _ = plan.block(kind)
  return (f'v{_LOOP_VERSION}.{cost_model.STEPS_VERSION}|{"sampled|" if sampled else ""}'
          f'{cost_model.device_kind()}'
          f'|{cost_model.model_key(engine.cfg)}'
          f'|B{batch_size}|P~{buckets.bucket(prompt_width, 64)}|kind{kind}-'
          f'{measurements.digest(repr(block))}'
          f'|{"rows" if plan.row_mapped else "batch"}|mesh'
          f'{plan.mesh.shape if plan.mesh is not None else None}'
          f'|V{plan.draft_vocab_size}|S~{buckets.bucket(min(steps, plan.max_new_tokens), 1)}'
          f'|C~{buckets.bucket(plan.capacity, 1)}')


def break_even(engine, prompts, lengths, kind: int, *, sampled: bool = False,
               refresh: bool = False, steps: int | None = None,
               repeats: int = 3) -> float:
  """Seconds per drafting step of `kind` over seconds per one-token step, for `engine`'s
  compiled loop on these prompts (greedy), measured once and cached (`measurements`; measured
  again once the machine is quiet where other processes disturbed it) for every plan within a
  factor of two of this one's prompt width, timed steps and cache (`_cache_key`).

  The two kinds of step take turns, and the fastest run of each counts: load from other work
  only ever adds time. (The median of per-pair ratios, used once, read 1.25 for a heads' block
  whose fastest runs cost 2.0 one-token steps, on a busy machine: drafting then ran where it
  lost.) The fastest call that runs no step is taken off each run, which a decoding call pays
  once (the demo model's heads' block at batch 1 read 1.6 one-token steps over 16 steps with
  it, 1.9 without); and runs of 64 steps, not 16, read 1.31 for its block at batch 8 where 16
  read 1.24 (decoding it cost about 1.4).

  Args:
    engine: a `decode.engine.Engine` whose plan has this kind.
    prompts: [B, P] int32, right-padded, checked; lengths: [B].
    kind: the kind of drafting step (1..K).
    sampled: for sampled rows (`engine.SAMPLED_TIMING`'s settings): their drafting steps cost
      more (sorting every node's distribution for top-p) and the one-token step little more.
    refresh: measure again even when cached.
    steps: loop steps per timed run; by default 64 steps' work of a batch of one (`ROW_STEPS`):
      64 steps, or fewer where rows are mapped one by one and a step costs each row's.
    repeats: timed runs of each kind (and calls that run no step). Three read within 2% of
      ten on SmolLM2's demo drafter in bfloat16 (both kinds, batch 1 greedy and batch 4 mapped
      rows sampled), and five no closer (within 3%); a server's first start on a model times
      four break-evens.

  Returns:
    The break-even in tokens per step (> 0; below 1: drafting costs nothing).
  """
  b, p = np.shape(prompts)
  if steps is None:
    steps = max(ROW_STEPS // b, 8) if engine.plan.row_mapped else ROW_STEPS
  key = _cache_key(engine, b, p, kind, sampled, steps)
  if not refresh:
    cached = measurements.lookup(_TABLE, key, lambda e: _valid(e['break_even']))
    if cached is not None:
      return float(cached['break_even'])

  # Every run starts from a copy of one prefill (16 ms, against 0.7 s for SmolLM2's 4 sampled
  # rows of 256 tokens): its break-evens at a server's batch took 21-26 s, not 26-34 s.
  prefilled = engine.timing_state(prompts, lengths, sampled=sampled)

  def timed(k: int) -> float:
    return engine.seconds_per_step(prompts, lengths, kind=k, steps=steps, overhead=overhead,
                                   sampled=sampled, prefilled=prefilled)

  overhead = 0.0
  timed(kind), timed(0)  # Compiles (decoding then reuses it) and warms up.
  watch = measurements.OtherWork()
  overhead = min(engine.seconds_per_call(prompts, lengths, prefilled=prefilled)
                 for _ in range(repeats))
  pairs = [(timed(kind), timed(0)) for _ in range(repeats)]
  if min(min(pair) for pair in pairs) <= 0:  # Steps too cheap to tell from a call's noise.
    overhead = 0.0
    pairs = [(timed(kind), timed(0)) for _ in range(repeats)]
  drafting, one_token = min(d for d, _ in pairs), min(o for _, o in pairs)
  ratio = drafting / one_token
  measurements.store(_TABLE, key, measurements.note_load({
      'break_even': ratio, 'seconds_per_step': {'drafting': drafting, 'one_token': one_token},
      'ratios': [d / o for d, o in pairs], 'measured': time.strftime('%Y-%m-%d %H:%M:%S')},
      watch, f'the break-even of drafting kind {kind} at batch {b}'))
  return ratio


def _valid(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6
