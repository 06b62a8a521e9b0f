"""EAGLE-2 tree drafting (`EagleDrafter.draft_tree`): every expanded node's children come from
the drafter run on that node's own path.

The oracle is the training forward (uncached, 'drafted' mode): with a node's path written into
the text after the accepted run, head d + 1 at the last accepted token reads exactly that path,
so its distribution is the one the node's children must come from. Exact decoding with these
trees: mtp/decode/speculative_test.py ('eagle3', dynamic trees).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import dynamic_trees
from mtp.decode import speculative_test as exact_tests
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import testing
from mtp.model.heads import eagle_test
from mtp.model.heads import tree_drafts

K, VOCAB = 3, 61
TREE = trees.tree_from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0)])


def _positions(b, t):
  return jnp.broadcast_to(jnp.arange(t), (b, t))


def _drafts(model, tokens, last, tree, **kwargs):
  """Prefill [B, T] tokens in one step, then draft `tree` below index `last` [B] of each row."""
  b, t = tokens.shape
  cache = model.init_cache(b, 64)
  lengths = jnp.zeros(b, jnp.int32)
  out, cache = model.step(jnp.asarray(tokens), _positions(b, t), cache, lengths)
  scratch = jnp.pad(jnp.asarray(tokens), ((0, 0), (0, tree.max_depth)))
  drafts, _ = model.draft_tree(out.features, scratch, jnp.asarray(last), cache, lengths, tree,
                               **kwargs)
  return drafts


@pytest.mark.parametrize('name', ['eagle', 'eagle3'])
def test_each_nodes_children_are_the_drafter_on_its_own_path(name):
  """Row 1's last accepted token is mid-run: the run's later slots are scratch to the tree."""
  model = decode_testing.head_model(name, mtp_num_heads=K)
  tokens = testing.random_tokens((2, 8), VOCAB, seed=3)
  last = np.array([6, 3])  # Index last + 1 holds the token the trunk chose: the tree's root.
  drafts = jax.tree.map(np.asarray, _drafts(model, tokens, last, TREE))
  assert drafts.tokens.shape == drafts.scores.shape == (2, TREE.num_nodes)
  expanded = [(row, node) for row in range(2) for node in range(TREE.num_nodes)
              if np.any(TREE.parent == node)]
  texts = []
  for row, node in expanded:
    path = TREE.node_paths[node][1:int(TREE.depth[node]) + 1]
    texts.append(np.concatenate([tokens[row, :last[row] + 2], drafts.tokens[row, path]]))
  # Every node's text in one forward, padded at its end: no position reads a later one.
  width = max(len(text) for text in texts)
  texts = jnp.asarray(np.stack([np.pad(text, (0, width - len(text))) for text in texts]))
  log_qs = np.asarray(jax.nn.log_softmax(model.logits(model(texts, _positions(*texts.shape)))))
  for i, (row, node) in enumerate(expanded):
    children = np.nonzero(TREE.parent == node)[0]
    log_q = log_qs[int(TREE.depth[node]) + 1, i, last[row]]
    ranked = np.argsort(-log_q, kind='stable')
    np.testing.assert_array_equal(drafts.tokens[row, children],
                                  ranked[TREE.rank[children]], err_msg=f'node {node}')
    np.testing.assert_allclose(drafts.scores[row, children],
                               drafts.scores[row, node] + log_q[drafts.tokens[row, children]],
                               atol=2e-4, err_msg=f'node {node}')
  # Second-ranked branches got children of their own, not the top-1 path's.
  node = {path: i + 1 for i, path in enumerate(TREE.choices)}

  def own(child):  # log q of a child under its parent's distribution.
    return drafts.scores[:, node[child]] - drafts.scores[:, node[child[:-1]]]
  assert np.all(np.abs(own((1, 0)) - own((0, 0))) > 1e-4)


def test_a_chain_is_the_top1_path_of_draft_logits():
  model = decode_testing.head_model('eagle3', mtp_num_heads=K)
  tokens = testing.random_tokens((2, 6), VOCAB, seed=4)
  last = np.array([5, 2])
  chain = trees.chain_tree(K)
  drafts = _drafts(model, tokens, last, chain)
  b = tokens.shape[0]
  cache = model.init_cache(b, 64)
  out, cache = model.step(jnp.asarray(tokens), _positions(b, 6), cache, jnp.zeros(b, jnp.int32))
  logits, _ = model.draft_logits(out.features, jnp.pad(jnp.asarray(tokens), ((0, 0), (0, K))),
                                 jnp.asarray(last), cache, jnp.zeros(b, jnp.int32), K)
  np.testing.assert_array_equal(drafts.tokens[:, 1:], np.argmax(logits, -1).T)
  log_q = jax.nn.log_softmax(logits, -1).max(-1).T  # [B, K]
  np.testing.assert_allclose(drafts.scores[:, 1:], np.cumsum(log_q, axis=1), atol=1e-5)


def test_a_draft_vocabulary_and_masked_ids_bound_every_node():
  model = decode_testing.head_model('eagle3', mtp_num_heads=K)
  tokens = testing.random_tokens((2, 6), VOCAB, seed=5)
  ids = jnp.arange(0, VOCAB, 2, dtype=jnp.int32)  # Even ids only.
  banned = ids[:10]

  def mask(logits):  # Over the draft vocabulary's ids, as the decode loop masks them.
    return jnp.where(jnp.isin(ids, banned), -jnp.inf, logits)

  drafts = _drafts(model, tokens, np.array([5, 1]), TREE, vocab=ids, mask=mask)
  drafted = np.asarray(drafts.tokens[:, 1:])
  assert np.all(drafted % 2 == 0) and not np.any(np.isin(drafted, np.asarray(banned)))
  assert np.all(np.isfinite(drafts.scores))
  # A child never scores above its parent.
  assert np.all(drafts.scores[:, 1:] <= drafts.scores[:, TREE.parent[1:]] + 1e-6)


def test_expanded_nodes_are_those_with_children():
  assert list(tree_drafts.expanded_nodes(TREE, 0)) == [0]
  assert [TREE.choices[n - 1] for n in tree_drafts.expanded_nodes(TREE, 1)] == [
      (0,), (1,), (2,)]
  assert [TREE.choices[n - 1] for n in tree_drafts.expanded_nodes(TREE, 2)] == [
      (0, 0), (0, 1), (1, 0), (2, 0)]
  assert not tree_drafts.expanded_nodes(TREE, 3).size


@pytest.mark.parametrize('budget', [3, 5, 8])
def test_a_budget_expands_each_rows_best_nodes_and_chooses_as_expanding_all(budget):
  """EAGLE-2's beam: with a budget of N nodes only each depth's best N - 1 expanded nodes run
  the layer; the best N nodes and their drafts are those of expanding every node."""
  model = decode_testing.head_model('eagle3', mtp_num_heads=K)
  tokens = testing.random_tokens((3, 8), VOCAB, seed=6)
  last = np.array([6, 3, 0])
  full = _drafts(model, tokens, last, TREE)
  pruned = _drafts(model, tokens, last, TREE, budget=budget)
  chosen = dynamic_trees.select(pruned.scores, budget)
  np.testing.assert_array_equal(chosen, dynamic_trees.select(full.scores, budget))
  for name in ('tokens', 'scores'):
    np.testing.assert_allclose(np.take_along_axis(getattr(pruned, name), chosen, axis=1),
                               np.take_along_axis(getattr(full, name), chosen, axis=1),
                               atol=1e-5, err_msg=name)
  if budget - 1 < len(tree_drafts.expanded_nodes(TREE, 2)):  # Some were left undrafted.
    assert np.any(np.isneginf(pruned.scores))


def test_sampled_generations_with_dynamic_trees_follow_the_target_distribution():
  """Exact rejection sampling over node-by-node dynamic trees (the beam prunes at budget 4):
  the distribution of whole generations."""
  model = decode_testing.head_model('eagle3', 5, vocab_size=exact_tests.VOCAB, mtp_num_heads=K)
  eagle_test.assert_sampling_follows_the_target(model, tree_budget=4)
