"""Speculative decoding is exact: it reproduces autoregressive decoding.

Greedy: token for token, for every head family, chains and trees, ragged batches, with
the model's own drafts, with oracle drafts (all accepted), adversarial drafts (none accepted),
and drafts right up to a random depth (ragged acceptance across rows and steps, which moves
tree paths through the cache); autoregressive decoding equals uncached decoding. Sampling: the
distribution of whole generations matches the exact one computed from the model, and a wrong
residual is caught by the same test. Everything through the public door (`plan.resolve`'s
engine, `decode.testing`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from mtp.decode import engine as engine_lib
from mtp.decode import sampling
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import mtp_model
from mtp.model import testing

HEAD_TYPES = ('medusa', 'parallel', 'sequential', 'streaming', 'eagle3')
# Names above that are option variants of a family: name -> (family, options).
VARIANTS = decode_testing.VARIANTS  # Option variants of a family, by name.
PROMPT_LENGTHS = np.array([7, 3, 5], np.int32)
MAX_NEW = 16
TREE = trees.tree_from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])
MODEL_DRAFTS, ORACLE, ADVERSARIAL, RAGGED = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class ReferenceDrafts:
  """Draft hook that overrides drafts using a known continuation `ref` [B, >= MAX_NEW + D].

  Per row (hook_data['mode']): MODEL_DRAFTS keeps the heads' drafts; ORACLE makes the path to
  the deepest leaf right and every other node wrong; ADVERSARIAL makes every node wrong (never
  the trunk's argmax); RAGGED makes the path to a leaf that changes with the row and step right
  down to a depth that changes too. Hashable, so equal hooks share a compiled decoder.
  """
  tree: trees.Tree
  vocab_size: int

  def __call__(self, drafts, num_generated, data):
    tree = self.tree
    b = drafts.shape[0]
    depth, rank = tree.depth[1:], tree.rank[1:]
    # Node n drafts output token index num_generated - 1 + depth(n).
    index = num_generated[:, None] + depth[None, :] - 1
    right = jnp.take_along_axis(data['ref'], index, axis=1)
    wrong = (right + 1 + rank[None, :]) % self.vocab_size
    leaves = np.nonzero(tree.num_children == 0)[0]
    deepest = leaves[np.argmax(tree.depth[leaves])]
    step_salt = (num_generated * 37 + jnp.arange(b) * 11) % 101
    leaf = jnp.where(data['mode'] == RAGGED, jnp.asarray(leaves)[step_salt % len(leaves)],
                     deepest)
    on_path = jnp.asarray(tree.attention_mask)[leaf][:, 1:]  # Ancestors of the leaf.
    cut = jnp.where(data['mode'] == RAGGED, step_salt % (tree.max_depth + 1), tree.max_depth)
    on_path &= depth[None, :] <= cut[:, None]
    mode = data['mode'][:, None]
    forced = jnp.where(on_path & (mode != ADVERSARIAL), right, wrong)
    return jnp.where(mode == MODEL_DRAFTS, drafts, forced)


def _hook_data(ref, mode):
  pad = np.zeros((ref.shape[0], TREE.max_depth + 1), np.int32)
  return dict(ref=jnp.asarray(np.concatenate([ref, pad], axis=1)),
              mode=jnp.asarray(np.broadcast_to(mode, (ref.shape[0],)), jnp.int32))


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((3, 7), 61, seed=1)


@pytest.fixture(scope='module')
def ar_model():
  return testing.tiny_model(0, mtp_num_heads=0)


@pytest.fixture(scope='module')
def models(ar_model):
  out = {h: decode_testing.head_model(h) for h in HEAD_TYPES}
  # The heads are built after the trunk, so every family shares the head-less model's trunk:
  # one autoregressive reference serves them all.
  for model in out.values():
    for a, b in zip(jax.tree.leaves(nnx.state(model.trunk)),
                    jax.tree.leaves(nnx.state(ar_model.trunk))):
      np.testing.assert_array_equal(a, b)
  return out


def _decode(model, prompts, lengths=None, **kwargs):
  return decode_testing.decode(model, prompts, lengths, **kwargs)


def _ar(model, prompts, lengths=None, **kwargs):
  return decode_testing.decode(model, prompts, lengths, decoder='autoregressive', **kwargs)


@pytest.fixture(scope='module')
def reference(ar_model, prompts):
  return _ar(ar_model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW)


def test_autoregressive_equals_uncached_decoding_with_ragged_prompts(ar_model, prompts,
                                                                      reference):
  want = decode_testing.reference_argmax(ar_model, prompts, PROMPT_LENGTHS, MAX_NEW)
  np.testing.assert_array_equal(reference.tokens, want)
  np.testing.assert_array_equal(reference.num_steps, [MAX_NEW - 1] * 3)  # The prefill: one.
  np.testing.assert_allclose(reference.mean_accepted, 1.0)


def _check_statistics(out, max_depth):
  hist = np.asarray(out.accepted_histogram)
  assert hist.shape == (3, max_depth + 2)
  assert hist[:, 0].sum() == 0
  np.testing.assert_array_equal(hist.sum(1), out.num_steps)
  emitted = (hist * np.arange(max_depth + 2)).sum(1)
  np.testing.assert_array_equal(emitted + 1, out.num_generated)  # + the prefill's token.


# Parallel heads' chain runs without a hook at batch 1 below (compiling costs test time).
@pytest.mark.parametrize('head_type,tree', [
    ('medusa', 3), ('medusa', TREE), ('parallel', TREE), ('sequential', 3),
    ('sequential', TREE), ('streaming', TREE), ('eagle3', 3), ('eagle3', TREE)],
    ids=['medusa-chain', 'medusa-tree', 'parallel-tree', 'sequential-chain', 'sequential-tree',
         'streaming-tree', 'eagle3-chain', 'eagle3-tree'])
def test_greedy_output_equals_autoregressive(models, ar_model, prompts, reference, head_type,
                                             tree):
  """One compiled decoder per case; the hook picks the drafts per row at run time."""
  model = models[head_type]
  resolved = trees.static_tree(tree, model.cfg.mtp_num_heads)
  hook = ReferenceDrafts(resolved, 61)
  ref = np.asarray(reference.tokens)
  depth = resolved.max_depth

  def run(mode, **kwargs):
    out = _decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, tree=tree,
                  draft_hook=hook, hook_data=_hook_data(ref, mode), **kwargs)
    _check_statistics(out, depth)
    return out

  # The heads' own drafts (random heads: a few get accepted).
  own = run(MODEL_DRAFTS)
  np.testing.assert_array_equal(own.tokens, ref)
  np.testing.assert_array_equal(own.num_generated, reference.num_generated)

  # Oracle: every step accepts the whole path but the last, which max_new_tokens may cut.
  oracle = run(ORACLE)
  np.testing.assert_array_equal(oracle.tokens, ref)
  hist = np.asarray(oracle.accepted_histogram)
  assert np.all(hist[:, depth + 1] >= oracle.num_steps - 1)
  np.testing.assert_array_equal(oracle.num_steps, -(-(MAX_NEW - 1) // (depth + 1)))

  # Adversarial: nothing is accepted, one token per step.
  adversarial = run(ADVERSARIAL)
  np.testing.assert_array_equal(adversarial.tokens, ref)
  np.testing.assert_array_equal(adversarial.accepted_histogram[:, 1], MAX_NEW - 1)

  # Ragged: rows accept different lengths (and tree paths) at every step.
  ragged = run(np.array([RAGGED, RAGGED, MODEL_DRAFTS]))
  np.testing.assert_array_equal(ragged.tokens, ref)
  assert np.count_nonzero(np.asarray(ragged.accepted_histogram[:2]).sum(0)) >= 3
  assert np.all(ragged.mean_accepted[:2] > 1.3)

  # EOS inside an accepted block: rows stop right after it, as one-token decoding would.
  eos = int(ref[0, 5])
  expected = _ar(ar_model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, eos_id=eos,
                 pad_id=-1)
  assert expected.num_generated[0] == 6
  for mode in (ORACLE, RAGGED):
    out = run(mode, eos_id=eos, pad_id=-1)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    np.testing.assert_array_equal(out.num_generated, expected.num_generated)


@pytest.mark.parametrize('head_type,tree', [('medusa', None), ('parallel', None),
                                            ('sequential', TREE)])
def test_batch_of_one_without_hooks(models, prompts, reference, head_type, tree):
  # Row 1 of the batched reference has this very prompt.
  out = _decode(models[head_type], prompts[1:2, :3], max_new_tokens=MAX_NEW, tree=tree)
  np.testing.assert_array_equal(out.tokens, reference.tokens[1:2])
  assert out.accepted_histogram.shape == (1, 5)


@pytest.mark.parametrize('head_type', HEAD_TYPES)
def test_lookup_drafts_are_exact_and_catch_repetitions(models, ar_model, prompts, head_type):
  """A greedy random model soon repeats itself: copies from its own text are accepted."""
  max_new = 40
  expected = _ar(ar_model, prompts, PROMPT_LENGTHS, max_new_tokens=max_new)
  steps = {}
  for lookup in (0, 6):  # Deeper than the heads: the lookup chain is not bound by them.
    out = _decode(models[head_type], prompts, PROMPT_LENGTHS, max_new_tokens=max_new,
                  tree=[(0,), (1,), (0, 0)], lookup=lookup)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    _check_statistics(out, max(2, lookup))  # The tree is 2 deep, the lookup chain 6.
    steps[lookup] = np.asarray(out.num_steps)
  # Fewer steps with lookup; by how much depends on the family: random streams whose drafts
  # repeat the main stream's token already pass many of row 2's repeats (55 against 65 steps).
  assert steps[6].sum() < steps[0].sum()
  assert steps[6][2] <= 15  # Row 2 is mostly one token repeated.


def test_a_model_without_heads_drafts_by_lookup_alone(ar_model, prompts):
  max_new = 40
  expected = _ar(ar_model, prompts, PROMPT_LENGTHS, max_new_tokens=max_new)
  out = _decode(ar_model, prompts, PROMPT_LENGTHS, max_new_tokens=max_new)  # speculative.
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  assert np.asarray(out.accepted_histogram).shape[1] == 8 + 2  # The lookup chain's 8 drafts.
  assert np.asarray(out.num_steps).sum() < 0.8 * np.asarray(expected.num_steps).sum()


@pytest.mark.parametrize('head_type', HEAD_TYPES)
def test_dynamic_trees_are_exact(models, prompts, reference, head_type):
  """Every row verifies its own tree each step (`tree_budget`), and the output is still
  autoregressive decoding's. A budget of the whole superset selects every node in order: the
  static tree's decoding step for step, which lets the oracle and ragged hooks (written for a
  static tree) drive the dynamic path through deep and ragged acceptance."""
  model = models[head_type]
  ref = np.asarray(reference.tokens)
  hook = ReferenceDrafts(TREE, 61)
  for budget in (3, 6):
    out = _decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, tree=TREE,
                  tree_budget=budget)
    np.testing.assert_array_equal(out.tokens, ref)
    _check_statistics(out, min(TREE.max_depth, budget - 1))  # Deeper nodes are never chosen.
  for mode in (MODEL_DRAFTS, ORACLE, np.array([RAGGED, RAGGED, MODEL_DRAFTS])):
    static, dynamic = (
        _decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, tree=TREE,
                draft_hook=hook, hook_data=_hook_data(ref, mode), **budget)
        for budget in ({}, dict(tree_budget=TREE.num_nodes)))
    np.testing.assert_array_equal(dynamic.tokens, ref)
    np.testing.assert_array_equal(dynamic.num_steps, static.num_steps)
    np.testing.assert_array_equal(dynamic.accepted_histogram, static.accepted_histogram)
  assert np.all(np.asarray(dynamic.mean_accepted[:2]) > 1.3)  # The ragged rows.


def test_dynamic_trees_stay_exact_where_drafts_pass(small_model):
  """Zero-initialised heads draft the sharpened trunk's argmax: many drafts pass, and greedy
  output stays exact. (Their probabilities are flat, so these trees are wide: a dynamic tree
  is as good as its heads' calibration.)"""
  prompts = testing.random_tokens((16, 4), VOCAB, seed=3)
  expected = _ar(small_model, prompts, max_new_tokens=24)
  out = _decode(small_model, prompts, max_new_tokens=24, tree_budget=4)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  assert np.asarray(out.accepted_histogram)[:, 2:].sum() > np.asarray(out.num_steps).sum() / 2


def test_no_recompilation_and_chunks(models, prompts, reference):
  model = models['medusa']
  engine = decode_testing.engine(model, max_new_tokens=MAX_NEW)
  ref = np.asarray(reference.tokens[1])
  eos = int(ref[7])
  stop = int(np.argmax(ref == eos)) + 1
  expected = np.where(np.arange(MAX_NEW) < stop, ref, 0)

  def run(**kwargs):
    return engine.generate(prompts[1:2, :3], [3], decode_testing.settings(
        engine, 1, **{'max_new_tokens': MAX_NEW, **kwargs}))

  run()
  compiled = engine_lib.compilations()
  np.testing.assert_array_equal(run(eos_id=eos, seed=4).tokens[0], expected)
  chunks = list(engine.chunks(prompts[1:2, :3], [3], decode_testing.settings(
      engine, 1, max_new_tokens=MAX_NEW, eos_id=eos), steps_per_chunk=2))
  np.testing.assert_array_equal(chunks[-1].tokens[0], expected)
  counts = [int(c.num_generated[0]) for c in chunks]
  assert counts == sorted(counts) and len(counts) > 2 and counts[-1] == stop
  # A new stop id, seed, chunking, token budget and sampling settings: the same compiled code.
  out = run(eos_id=eos, temperature=0.7, top_k=5, top_p=0.9, seed=1)
  assert 1 <= int(out.num_generated[0]) <= MAX_NEW
  np.testing.assert_array_equal(run(max_new_tokens=5).tokens[0, :5], ref[:5])
  assert engine_lib.compilations() == compiled


# ------------------------------------------------------------------------------------------
# Sampling: distribution of whole generations.
# ------------------------------------------------------------------------------------------

SAMPLING = dict(temperature=0.8, top_k=0, top_p=0.95)
VOCAB, NEW, ROWS = 8, 3, 4000


@pytest.fixture(scope='module')
def small_model():
  # Zero-initialised Medusa heads draft the trunk's own argmax (shifted by one position):
  # often a likely token, so drafts are accepted often enough to matter.
  model = mtp_model.MTPModel(testing.tiny_config(vocab_size=VOCAB, mtp_num_heads=2),
                             rngs=nnx.Rngs(5))
  # Sharpen the random model (tied embeddings) so that a biased rule shows clearly.
  model.trunk.embedding.embedding[...] *= 4.0
  return model


def _exact_distribution(model, prompt):
  """P(x_1, x_2, x_3 | prompt) under the shaped distribution, [V, V, V]."""
  v = VOCAB
  grid = np.stack(np.meshgrid(*[np.arange(v)] * NEW, indexing='ij'), -1).reshape(-1, NEW)
  seqs = np.concatenate([np.broadcast_to(prompt, (len(grid), len(prompt))), grid], 1)
  t = seqs.shape[1]
  forward = jax.jit(lambda x: sampling.target_probs(
      model.logits(model(x, jnp.broadcast_to(jnp.arange(t), x.shape))[0]), **SAMPLING))
  probs = forward(jnp.asarray(seqs))  # [N, T, V]
  p = len(prompt)
  joint = np.ones(len(grid))
  for i in range(NEW):
    joint *= np.asarray(probs)[np.arange(len(grid)), p - 1 + i, grid[:, i]]
  return joint.reshape((v,) * NEW)


def _chisquare_p(samples, expected):
  """Goodness of fit of [N, NEW] samples to the joint distribution; sparse cells pooled."""
  counts = np.zeros(expected.size)
  np.add.at(counts, np.ravel_multi_index(samples.T, expected.shape), 1)
  expected = expected.ravel() * len(samples)
  big = expected >= 5
  assert counts[expected == 0].sum() == 0, 'a sample with probability zero'
  obs, exp = counts[big], expected[big]
  if expected[~big].sum() > 0:
    obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
  return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope='module')
def sampled(small_model):
  prompt = np.array([1, 5, 2], np.int32)
  prompts = np.broadcast_to(prompt, (ROWS, 3))
  exact = _exact_distribution(small_model, prompt)
  return small_model, prompts, exact


def test_sampled_generations_follow_the_target_distribution(sampled):
  model, prompts, exact = sampled
  ar = _ar(model, prompts, max_new_tokens=NEW, seed=1, **SAMPLING)
  sp = _decode(model, prompts, max_new_tokens=NEW, seed=2, **SAMPLING)
  assert _chisquare_p(np.asarray(ar.tokens), exact) > 1e-3
  assert _chisquare_p(np.asarray(sp.tokens), exact) > 1e-3
  # Drafts matter here: some steps accept them (else the test would prove little).
  assert np.asarray(sp.accepted_histogram)[:, 2:].sum() > ROWS // 10


def test_sampling_with_lookup_drafts_beside_a_tree_follows_the_target_distribution(sampled):
  """Prompt lookup's copies hang beside the heads' tree (siblings of its first nodes): the
  multi-candidate rejection sampler tries them after the heads' children, exactly."""
  model, prompts, exact = sampled
  sp = _decode(model, prompts, max_new_tokens=NEW, seed=5, tree=[(0,), (1,), (0, 0)], lookup=2,
               **SAMPLING)
  assert _chisquare_p(np.asarray(sp.tokens), exact) > 1e-3
  assert np.asarray(sp.accepted_histogram)[:, 2:].sum() > ROWS // 10


def test_sampling_with_dynamic_trees_follows_the_target_distribution(sampled):
  model, prompts, exact = sampled
  sp = _decode(model, prompts, max_new_tokens=NEW, seed=3, tree_budget=4, **SAMPLING)
  assert _chisquare_p(np.asarray(sp.tokens), exact) > 1e-3
  assert np.asarray(sp.accepted_histogram)[:, 2:].sum() > ROWS // 10


@dataclasses.dataclass(frozen=True)
class _Identity:
  """A draft hook that changes nothing (a compiled decoder of its own)."""

  def __call__(self, drafts, num_generated, data):
    return drafts


def test_negative_control_a_wrong_residual_is_caught(sampled, monkeypatch):
  model, prompts, exact = sampled

  def resample_from_p(p, q):  # The classic bug: on rejection, sample p instead of the residual.
    del q
    return p

  # A new draft hook is a new compiled decoder: the monkeypatched rule is traced in.
  monkeypatch.setattr(sampling, '_residual', resample_from_p)
  sp = _decode(model, prompts, max_new_tokens=NEW, seed=2, draft_hook=_Identity(),
               **SAMPLING)
  assert _chisquare_p(np.asarray(sp.tokens), exact) < 1e-8


# ------------------------------------------------------------------------------------------
# Bad input.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize('change,message', [
    (dict(tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), 'tree depth 4 exceeds the number of '
     'MTP heads 3'),
    (dict(tree=4), 'chain length 4 exceeds the number of MTP heads 3'),
    (dict(tree=0), 'chain length must be >= 1'),
    (dict(prompt_lengths=[0, 3, 5]), 'empty prompt in row 0'),
    (dict(temperature=-1.0), 'temperature must be >= 0'),
    (dict(top_p=1.01), r'top_p must be in \(0, 1\]'),
    (dict(capacity=14), 'capacity must be an integer >= '),
    (dict(tree_budget=1), 'tree_budget must be an integer >= 2'),
    (dict(tree_budget=70), r'tree_budget must be an integer in \[2, 64\]'),
    (dict(tree=TREE, tree_budget=10), r'tree_budget must be an integer in \[2, 9\]'),
    (dict(tree_budget=4, lookup=2), 'drafts from the heads alone'),
    (dict(lookup=65), r'lookup \(--lookup\) must be at most 64'),
    (dict(decoder='beam'), 'decoder must be one of'),
    (dict(tree='bushy'), 'tree must be one of'),
    (dict(decoder='autoregressive', tree=2), 'apply to the drafting decoders'),
])
def test_bad_input_is_named_before_compiling(models, prompts, change, message):
  kwargs = {**dict(prompt_lengths=PROMPT_LENGTHS, max_new_tokens=4), **change}
  lengths = kwargs.pop('prompt_lengths')
  compiled = engine_lib.compilations()
  with pytest.raises(ValueError, match=message):
    _decode(models['parallel'], prompts, lengths, **kwargs)
  assert engine_lib.compilations() == compiled


def test_a_model_without_heads_is_named_where_lookup_is_off(ar_model, prompts):
  with pytest.raises(ValueError, match='no MTP heads'):
    _decode(ar_model, prompts, max_new_tokens=4, lookup=0)
  with pytest.raises(ValueError, match=r'token id -1 at prompt row 0, position 2'):
    _decode(testing.tiny_model(0), np.array([[3, 4, -1]]), max_new_tokens=4)
