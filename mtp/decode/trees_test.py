"""Tests for mtp.decode.trees."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import trees

EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _brute_mask(parent):
  n = len(parent)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  return mask


def test_example_tree_structure():
  t = trees.tree_from_choices(EXAMPLE)
  assert t.num_nodes == 7 and t.max_depth == 3
  assert t.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
  np.testing.assert_array_equal(t.parent, [-1, 0, 0, 1, 1, 2, 3])
  np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 2, 3])
  np.testing.assert_array_equal(t.rank, [-1, 0, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(
      t.children, [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]])
  np.testing.assert_array_equal(t.num_children, [2, 2, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(t.leaf_paths, [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]])
  np.testing.assert_array_equal(t.node_paths[6], [0, 1, 3, 6])
  np.testing.assert_array_equal(t.node_paths[2], [0, 2, -1, -1])
  np.testing.assert_array_equal(t.attention_mask, _brute_mask(t.parent))
  assert t.attention_mask[6].tolist() == [True, True, False, True, False, False, True]
  assert t.level_width == (2, 2, 1)
  assert t.topk_per_depth == (2, 2, 1)
  assert not t.is_chain


def test_bfs_order_parents_precede_children():
  t = trees.medusa_default_tree()
  assert np.all(t.parent[1:] < np.arange(1, t.num_nodes))
  assert np.all(np.diff(t.depth) >= 0)
  np.testing.assert_array_equal(t.attention_mask, _brute_mask(t.parent))
  all_paths = ((),) + t.choices
  for n in range(1, t.num_nodes):  # Node n holds its parent's path plus its own rank.
    assert all_paths[n] == all_paths[t.parent[n]] + (t.rank[n],)
    assert len(all_paths[n]) == t.depth[n]


def test_order_of_choices_does_not_matter_and_hash():
  a = trees.tree_from_choices(EXAMPLE)
  b = trees.tree_from_choices(list(reversed(EXAMPLE)))
  assert a == b and hash(a) == hash(b)
  assert a != trees.chain_tree(3)
  with pytest.raises(ValueError):
    a.parent[0] = 3  # Static structure is read-only.


def test_tree_is_jit_static():
  t = trees.tree_from_choices(EXAMPLE)
  f = jax.jit(lambda tree, x: x + tree.num_nodes + jnp.asarray(tree.depth).sum(),
              static_argnums=0)
  assert int(f(t, 1)) == 1 + 7 + 11


def test_not_prefix_closed():
  with pytest.raises(ValueError, match=r'prefix-closed.*\(0, 1, 0\).*\(0, 1\)'):
    trees.tree_from_choices([(0,), (0, 0), (0, 1, 0)])
  with pytest.raises(ValueError, match='prefix-closed'):
    trees.tree_from_choices([(1, 0)])


def test_bad_paths():
  with pytest.raises(ValueError, match='more than once'):
    trees.tree_from_choices([(0,), (0,)])
  with pytest.raises(ValueError, match=r'rank -1 outside \[0, '):
    trees.tree_from_choices([(-1,)])
  with pytest.raises(ValueError, match='non-empty'):
    trees.tree_from_choices([()])
  # Once read as rank 0 (0.5, True) or crashed with an OverflowError (a huge rank).
  for bad, match in ([[0.5]], 'not an integer: 0.5'), ([[0], [True]], 'not an integer: True'), (
      [[0], [99999999999]], 'rank 99999999999 outside'), (['01'], 'sequence of ranks'):
    with pytest.raises(ValueError, match=match):
      trees.tree_from_choices(bad)
  assert trees.tree_from_choices([[np.int64(0)], (np.int32(1),)]).num_nodes == 3


def test_too_deep():
  with pytest.raises(ValueError, match=r'depth 3 exceeds the number of MTP heads 2'):
    trees.tree_from_choices(EXAMPLE, num_heads=2)
  trees.tree_from_choices(EXAMPLE, num_heads=3)
  with pytest.raises(ValueError, match=r'depth 4 .* heads 3'):
    trees.medusa_default_tree().check_num_heads(3)


def test_chain_tree():
  t = trees.chain_tree(4)
  assert t.num_nodes == 5 and t.max_depth == 4 and t.is_chain
  np.testing.assert_array_equal(t.parent, [-1, 0, 1, 2, 3])
  np.testing.assert_array_equal(t.depth, np.arange(5))
  np.testing.assert_array_equal(t.rank, [-1, 0, 0, 0, 0])
  np.testing.assert_array_equal(t.attention_mask, np.tril(np.ones((5, 5), bool)))
  np.testing.assert_array_equal(t.children[:, 0], [1, 2, 3, 4, -1])
  np.testing.assert_array_equal(t.leaf_paths, [[0, 1, 2, 3, 4]])
  assert trees.chain_tree(0).num_nodes == 1
  assert t == trees.tree_from_choices([(0, 0, 0), (0,), (0, 0, 0, 0), (0, 0)])


def test_medusa_default_tree():
  t = trees.medusa_default_tree()
  assert t.num_nodes == 24 and t.max_depth == 4
  # The literal list is what the documented construction gives.
  assert t == trees.tree_from_accuracies(trees.TYPICAL_HEAD_ACCURACIES, 24)
  t3 = trees.medusa_default_tree(num_heads=3)
  assert t3.max_depth == 3 and t3.num_nodes < 24
  assert trees.medusa_default_tree(num_heads=1).choices == ((0,), (1,), (2,), (3,), (4,))


def test_tree_from_accuracies_obvious():
  chain = trees.tree_from_accuracies([[0.9, 0.05], [0.8, 0.1], [0.5, 0.2]], 4)
  assert chain == trees.chain_tree(3)
  wide = trees.tree_from_accuracies([[0.5, 0.4], [0.3, 0.1]], 4)
  assert wide.choices == ((0,), (1,), (0, 0))
  # Ties are broken deterministically (shorter, then smaller paths).
  tie = trees.tree_from_accuracies([[0.5, 0.5], [1.0, 1.0]], 3)
  assert tie.choices == ((0,), (1,))
  assert trees.tree_from_accuracies([[0.5]], 1).num_nodes == 1
  with pytest.raises(ValueError, match='num_nodes'):
    trees.tree_from_accuracies([[0.5, 0.4]], 4)
  with pytest.raises(ValueError, match=r'\[0, 1\]'):
    trees.tree_from_accuracies([[1.5]], 2)


def _all_paths(d, r):
  return [p for k in range(1, d + 1) for p in itertools.product(range(r), repeat=k)]


def test_tree_from_accuracies_is_optimal():
  rng = np.random.default_rng(0)
  paths = _all_paths(2, 3)
  for _ in range(3):
    acc = rng.dirichlet(np.ones(4), size=2)[:, :3]
    for n in (2, 4, 6, 9):
      best = 0.0
      for subset in itertools.combinations(paths, n - 1):
        s = set(subset)
        if all(len(p) == 1 or p[:-1] in s for p in subset):
          best = max(best, trees.expected_accepted_length(trees.tree_from_choices(subset), acc))
      got = trees.expected_accepted_length(trees.tree_from_accuracies(acc, n), acc)
      assert got == pytest.approx(best, rel=1e-12)


def test_expected_accepted_length():
  acc = [[0.8, 0.1], [0.5, 0.2], [0.5, 0.3]]
  assert trees.expected_accepted_length(trees.chain_tree(3), acc) == pytest.approx(
      0.8 + 0.4 + 0.2)
  t = trees.tree_from_choices([(0,), (1,), (1, 1)])
  assert trees.expected_accepted_length(t, acc) == pytest.approx(0.8 + 0.1 + 0.02)
  assert trees.expected_accepted_length(trees.chain_tree(0), acc) == 0.0
  with pytest.raises(ValueError, match='top-k'):
    trees.expected_accepted_length(trees.chain_tree(4), acc)


def test_choose_tree_size():
  acc = [[0.9, 0.05], [0.8, 0.1], [0.7, 0.1]]
  # Free verification: the biggest tree wins. Linear cost: speculation cannot pay off.
  assert trees.choose_tree_size(acc, lambda t: 1.0, [1, 2, 4, 8]) == 8
  assert trees.choose_tree_size(acc, lambda t: float(t), [1, 2, 4, 8]) == 1
  # Chain of 3 drafts: (1 + .9 + .72 + .504) / 1.3 beats 1 / 1 and 1.9 / 1.25.
  cost = {1: 1.0, 2: 1.25, 4: 1.3, 16: 3.0}
  assert trees.choose_tree_size(acc, cost, [1, 2, 4]) == 4
  assert trees.choose_tree_size(acc, cost, [3]) == 3  # Interpolated.
  with pytest.raises(ValueError, match='cannot price'):
    trees.choose_tree_size(acc, {2: 1.25, 4: 1.3}, [1, 2])
  with pytest.raises(ValueError, match='empty'):
    trees.choose_tree_size(acc, cost, [])


def test_a_lookup_chain_hangs_below_the_root_after_the_head_nodes():
  base = trees.tree_from_choices([(0,), (1,), (0, 0)])
  tree = trees.with_lookup(base, 3)
  assert (tree.num_nodes, tree.num_head_nodes, tree.lookup_depth) == (7, 4, 3)
  np.testing.assert_array_equal(tree.parent, [-1, 0, 0, 1, 0, 4, 5])
  np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2, 1, 2, 3])
  assert (tree.max_depth, tree.head_depth, tree.topk_per_depth) == (3, 2, (2, 1))
  np.testing.assert_array_equal(tree.attention_mask[6], [1, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(tree.node_paths[6], [0, 4, 5, 6])
  assert not tree.is_chain and not trees.with_lookup(trees.chain_tree(2), 1).is_chain
  assert tree == trees.with_lookup(base, 3) and tree != base and tree != trees.with_lookup(base, 2)
  assert hash(tree) == hash(trees.with_lookup(base, 3))
  tree.check_num_heads(2)  # The lookup chain is deeper than the heads: no heads needed for it.
  with pytest.raises(ValueError, match='already has a lookup chain'):
    trees.with_lookup(tree, 1)
  with pytest.raises(ValueError, match='at least one node'):
    trees.with_lookup(base, 0)


def test_attention_order_lists_the_longest_path_first_then_the_rest_in_node_order():
  lookup = trees.with_lookup(trees.tree_from_choices([(0,), (1,), (0, 0)]), 3)
  np.testing.assert_array_equal(trees.attention_order(lookup), [0, 4, 5, 6, 1, 2, 3])
  heads = trees.tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])  # Ties: the first.
  np.testing.assert_array_equal(trees.attention_order(heads), [0, 1, 3, 5, 2, 4])
  np.testing.assert_array_equal(trees.attention_order(trees.chain_tree(3)), [0, 1, 2, 3])
  for tree in (lookup, heads, trees.medusa_default_tree(4)):
    order = trees.attention_order(tree)
    assert sorted(order) == list(range(tree.num_nodes))
    slot = np.argsort(order)
    assert all(slot[tree.parent[node]] < slot[node] for node in range(1, tree.num_nodes))
    mask = tree.attention_mask[order][:, order]  # The path's nodes see a prefix of the block.
    depth = tree.max_depth
    np.testing.assert_array_equal(mask[:depth + 1, :depth + 1], np.tril(np.ones((depth + 1,) * 2)))
    assert not mask[:depth + 1, depth + 1:].any()


def test_without_lookup_is_the_heads_part_of_the_tree():
  base = trees.tree_from_choices([[0], [1], [0, 0]])
  whole = trees.with_lookup(base, 3)
  heads = whole.without_lookup()
  assert heads == base and heads.num_nodes == base.num_nodes
  np.testing.assert_array_equal(heads.attention_mask, whole.attention_mask[:4, :4])
  assert trees.with_lookup(trees.chain_tree(2), 2).without_lookup().is_chain
  assert base.without_lookup() is base


def test_best_tree_takes_every_node_the_shape_allows():
  acc = [[0.5, 0.2], [0.4, 0.1]]
  assert trees.best_tree(acc, 4) == trees.tree_from_accuracies(acc, 4)
  assert trees.best_tree(acc, 64).num_nodes == 1 + 2 + 4
