"""Dynamic trees: the selection is the best-scoring prefix-closed set, and the per-row trees
it yields are the static trees of the same nodes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import dynamic_trees
from mtp.decode import trees
from mtp.model.heads import tree_drafts

SUPERSET = trees.tree_from_choices(
    [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
     (1, 0, 0)])


def _log_probs(seed, batch=4, depth=3, vocab=16):
  """Random heads' log-probabilities [B, depth, V] (log-softmax)."""
  logits = np.random.default_rng(seed).normal(size=(batch, depth, vocab)) * 2
  return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)


def _select(log_probs, budget):
  """`select` on the superset scored by depth (`tree_drafts.by_depth`: head d's distribution
  for every node at depth d - 1)."""
  drafts = tree_drafts.by_depth(SUPERSET, jnp.transpose(jnp.asarray(log_probs), (1, 0, 2)),
                                lambda index: index)
  return dynamic_trees.select(drafts.scores, budget)


def _path_score(tree, node, log_probs_row):
  ranked = -np.sort(-log_probs_row, axis=-1)  # [depth, V], best first.
  return sum(ranked[tree.depth[n] - 1, tree.rank[n]] for n in tree.node_paths[node] if n > 0)


def test_scores_sum_the_log_probabilities_along_each_path():
  lp = _log_probs(0)
  drafts = tree_drafts.by_depth(SUPERSET, jnp.transpose(jnp.asarray(lp), (1, 0, 2)),
                                lambda index: index)
  for b in range(lp.shape[0]):
    expected = [_path_score(SUPERSET, n, lp[b]) for n in range(SUPERSET.num_nodes)]
    np.testing.assert_allclose(drafts.scores[b], expected, rtol=1e-5, atol=1e-5)
    ranked = np.argsort(-lp[b], axis=-1, kind='stable')
    np.testing.assert_array_equal(
        drafts.tokens[b, 1:], ranked[SUPERSET.depth[1:] - 1, SUPERSET.rank[1:]])


@pytest.mark.parametrize('budget', [2, 4, 7, SUPERSET.num_nodes])
def test_selection_is_the_best_prefix_closed_set(budget):
  """Brute force over every prefix-closed set of budget - 1 nodes: none scores more in total
  (the best set is the top scores, as a child never outscores its parent)."""
  lp = _log_probs(1)
  chosen = np.asarray(_select(lp, budget))
  assert chosen.shape == (lp.shape[0], budget)
  for b in range(lp.shape[0]):
    row = list(chosen[b])
    assert row[0] == 0 and row == sorted(row) and len(set(row)) == budget
    assert all(SUPERSET.parent[n] in row for n in row[1:])  # Prefix-closed.
    score = {n: _path_score(SUPERSET, n, lp[b]) for n in range(1, SUPERSET.num_nodes)}
    best = -np.inf
    for subset in itertools.combinations(range(1, SUPERSET.num_nodes), budget - 1):
      if all(SUPERSET.parent[n] == 0 or SUPERSET.parent[n] in subset for n in subset):
        best = max(best, sum(score[n] for n in subset))
    np.testing.assert_allclose(sum(score[n] for n in row[1:]), best, rtol=1e-5)


def test_ties_keep_the_selection_prefix_closed():
  """Certain heads (log q = 0 at rank 0) tie a child with its parent: the parent goes first."""
  lp = np.full((1, 3, 3), -100.0, np.float32)
  lp[:, :, 0] = 0.0
  chosen = np.asarray(_select(lp, 4))[0]
  assert [SUPERSET.choices[n - 1] for n in chosen[1:]] == [(0,), (0, 0), (0, 0, 0)]


def test_confident_heads_grow_deep_and_unsure_heads_wide():
  confident = np.log(np.array([[0.9, 0.05, 0.05]] * 3, np.float32))[None]
  unsure = np.log(np.array([[0.34, 0.33, 0.33]] * 3, np.float32))[None]
  lp = jnp.asarray(np.concatenate([confident, unsure]))
  chosen = np.asarray(_select(lp, 4))
  depths = SUPERSET.depth[chosen]
  assert list(depths[0]) == [0, 1, 2, 3]  # A chain.
  assert list(depths[1]) == [0, 1, 1, 1]  # Every rank of head 1.


def test_row_trees_are_the_static_trees_of_the_chosen_nodes():
  lp = _log_probs(2, batch=6)
  chosen = _select(lp, 6)
  rows = jax.jit(dynamic_trees.row_trees, static_argnums=0)(SUPERSET, chosen)
  for b in range(lp.shape[0]):
    static = trees.tree_from_choices([SUPERSET.choices[n - 1] for n in np.asarray(chosen[b, 1:])])
    for name in ('parent', 'depth', 'num_children', 'attention_mask'):
      np.testing.assert_array_equal(getattr(rows, name)[b], getattr(static, name), err_msg=name)
    width = static.node_paths.shape[1]
    np.testing.assert_array_equal(rows.node_paths[b, :, :width], static.node_paths)
    assert np.all(np.asarray(rows.node_paths[b, :, width:]) == -1)
    kids = static.children.shape[1]
    np.testing.assert_array_equal(rows.children[b, :, :kids], static.children)
    assert np.all(np.asarray(rows.children[b, :, kids:]) == -1)
  assert rows.max_tries >= max(dynamic_trees.max_tries(SUPERSET), 1)


def test_the_whole_superset_is_the_static_tree():
  chosen = _select(_log_probs(3), SUPERSET.num_nodes)
  rows = dynamic_trees.row_trees(SUPERSET, chosen)
  static = dynamic_trees.broadcast(SUPERSET, 4)
  for a, b in zip(jax.tree.leaves(rows), jax.tree.leaves(static)):
    np.testing.assert_array_equal(a, b)
  assert (rows.max_depth, rows.max_children, rows.max_tries) == (
      static.max_depth, static.max_children, static.max_tries)


def test_max_tries_counts_the_walk_to_each_node_and_its_children():
  # Root tries (0,), (1,), (2,): reaching (2,) takes 3 tests, then its child 1 more.
  tree = trees.tree_from_choices([(0,), (1,), (2,), (2, 0)])
  assert dynamic_trees.max_tries(tree) == 4
  assert dynamic_trees.max_tries(trees.chain_tree(3)) == 3


def test_default_superset_and_bad_budgets():
  superset = dynamic_trees.default_superset(4)
  assert superset.num_nodes == 64 and superset.max_depth == 4
  assert dynamic_trees.default_superset(1).num_nodes == 6  # Every rank of one head.
  with pytest.raises(ValueError, match='needs MTP heads'):
    dynamic_trees.default_superset(0)
  for budget in (1, 65, True, 2.5):
    with pytest.raises(ValueError, match=r'tree_budget must be an integer in \[2, 64\]'):
      dynamic_trees.check_superset(superset, budget)
  with pytest.raises(ValueError, match='lookup chain'):
    dynamic_trees.check_superset(trees.with_lookup(superset, 2), 4)


def test_nodes_out_of_the_budgets_reach_are_cut():
  superset = dynamic_trees.default_superset(4)
  assert dynamic_trees.reachable(superset, 3).max_depth == 2  # Root + a chain of 2 at most.
  assert dynamic_trees.reachable(superset, 5) is superset
  cut = dynamic_trees.reachable(superset, 3)
  assert set(cut.choices) == {p for p in superset.choices if len(p) <= 2}
