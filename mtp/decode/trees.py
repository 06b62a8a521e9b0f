"""Static candidate trees for self-speculative decoding.

A tree is given Medusa-style as a list of paths ("choices"): each path is a tuple of top-k
ranks, one per depth. Path (0, 1) is the node holding the rank-1 candidate of head 2 below the
node holding the rank-0 candidate of head 1. Node 0 is the root: the last accepted token. The
whole tree is verified by one trunk forward pass over its N tokens with `attention_mask`.

Trees are static: plain numpy arrays inside a frozen dataclass that hashes by its structure, so
a `Tree` can be a static argument of `jax.jit`. Importing this module is cheap (no JAX): the
launchers read the tree names (`NAMES`) and parse `--tree` (`parse`) before JAX starts.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import numbers
from typing import Callable, Mapping, Sequence

import numpy as np

Path = tuple[int, ...]
# A user's tree: a name of `NAMES`, a chain length, Medusa-style choices, a `Tree`, or None.
TreeChoice = 'Tree | str | int | Sequence[Sequence[int]] | None'
# The tree names users pass (`tree=`, `--tree`), the one list every caller reads. The first two
# are static (built from the model's heads alone); the others are built by the decode plan from
# the heads' measured accuracies and this hardware's cost curve (`MEASURED`).
CHAIN, DEFAULT, AUTO, DYNAMIC = 'chain', 'default', 'auto', 'dynamic'
NAMES = {
    CHAIN: 'every head\'s top-1 draft in a chain',
    DEFAULT: 'a static Medusa-style tree of 24 nodes cut to the model\'s heads',
    AUTO: 'built from the heads\' measured top-k accuracies, sized by this hardware\'s '
            'verification cost',
    DYNAMIC: 'EAGLE-2: each step and row verifies the nodes its heads find most probable, '
               'out of the best 64-node tree for their measured accuracies',
}
MEASURED = (AUTO, DYNAMIC)
# A rank is an index into a head's top-k candidates: far below any vocabulary. The bound keeps
# every array of the tree within int32.
_MAX_RANK = 2 ** 20


@dataclasses.dataclass(frozen=True, eq=False)
class Tree:
  """A static candidate tree; nodes in BFS order (by depth, then by path), root = node 0.

  Attributes:
    choices: the non-root paths in node order (node i + 1 holds choices[i]).
    num_nodes: N, root included.
    parent: [N] int32, parent node index, -1 for the root.
    depth: [N] int32, root 0; node n is drafted by head depth[n] and sits at position offset
      depth[n] from the root.
    rank: [N] int32, top-k rank of the node's candidate within its head, -1 for the root.
    attention_mask: [N, N] bool, node i sees node j iff j is i or an ancestor of i.
    children: [N, max_children] int32, children in rank order, padded with -1.
    num_children: [N] int32.
    node_paths: [N, max_depth + 1] int32, root-first path to each node, padded with -1.
    leaf_paths: [num_leaves, max_depth + 1] int32, root-first path to each leaf (in node
      order of the leaves), padded with -1.
    max_depth: the tree's depth (with a lookup chain, possibly more than its heads).
    max_children: largest number of children of a node (at least 1, for array shapes).
    level_width: [max_depth] tuple, largest number of children of a node at depth d.
    topk_per_depth: [max_depth] tuple, how many top candidates head d + 1 must provide.
    lookup_depth: nodes hung below the root after the heads' nodes: other drafters' nodes,
      such as a prompt-lookup chain (`with_lookup`, `join`); 0 for a tree of head drafts only.
  """
  choices: tuple[Path, ...]
  num_nodes: int
  parent: np.ndarray
  depth: np.ndarray
  rank: np.ndarray
  attention_mask: np.ndarray
  children: np.ndarray
  num_children: np.ndarray
  node_paths: np.ndarray
  leaf_paths: np.ndarray
  max_depth: int
  max_children: int
  level_width: tuple[int, ...]
  topk_per_depth: tuple[int, ...]
  lookup_depth: int = 0

  # Equality and hashing by the defining structure keep the tree usable as a jit static
  # argument.
  def __eq__(self, other):
    return (isinstance(other, Tree) and self.choices == other.choices
            and self.lookup_depth == other.lookup_depth
            and np.array_equal(self.parent, other.parent))

  def __hash__(self):
    return hash((self.choices, self.lookup_depth, self.parent.tobytes()))

  def __repr__(self):
    lookup = f', lookup_depth={self.lookup_depth}' if self.lookup_depth else ''
    return (f'Tree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, '
            f'choices={self.choices}{lookup})')

  @property
  def num_head_nodes(self) -> int:
    """Nodes drafted by the heads, root included: nodes 0 .. num_head_nodes - 1."""
    return self.num_nodes - self.lookup_depth

  @property
  def head_depth(self) -> int:
    """The number of heads the tree needs (the depth of its deepest head-drafted node)."""
    return max((len(p) for p in self.choices), default=0)

  def without_lookup(self) -> 'Tree':
    """The heads' part of the tree: nodes 0 .. num_head_nodes - 1, the same nodes in order."""
    if not self.lookup_depth:
      return self
    return _assemble(self.choices, self.parent[:self.num_head_nodes],
                     self.rank[:self.num_head_nodes])

  @property
  def is_chain(self) -> bool:
    return not self.lookup_depth and all(p == (0,) * len(p) for p in self.choices)

  def check_num_heads(self, num_heads: int) -> None:
    """Raises ValueError if the tree is deeper than the model has heads."""
    if self.head_depth > num_heads:
      raise ValueError(
          f'tree depth {self.head_depth} exceeds the number of MTP heads {num_heads}: head d '
          'drafts depth d, so a tree needs at least as many heads as its depth')


def _validate_choices(choices: Sequence[Sequence[int]]) -> tuple[Path, ...]:
  paths = []
  for c in choices:
    if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
      raise ValueError(f'each tree path must be a sequence of ranks, got {c!r}')
    for r in c:
      # Ranks are whole numbers: 0.5 or True is a typo, not rank 0 or 1.
      if isinstance(r, bool) or not isinstance(r, (numbers.Integral, np.integer)):
        raise ValueError(f'tree path {list(c)} has a rank that is not an integer: {r!r}')
      if not 0 <= r < _MAX_RANK:
        raise ValueError(f'tree path {list(c)} has rank {r} outside [0, {_MAX_RANK})')
    p = tuple(int(r) for r in c)
    if not p:
      raise ValueError('tree paths must be non-empty (the root is implicit)')
    paths.append(p)
  seen = set()
  for p in paths:
    if p in seen:
      raise ValueError(f'tree path {p} appears more than once')
    seen.add(p)
  for p in paths:
    if len(p) > 1 and p[:-1] not in seen:
      raise ValueError(
          f'tree paths must be prefix-closed: path {p} is present but its parent {p[:-1]} is not')
  return tuple(sorted(paths, key=lambda p: (len(p), p)))


def tree_from_choices(choices: Sequence[Sequence[int]], num_heads: int | None = None) -> Tree:
  """Builds a `Tree` from Medusa-style paths of top-k ranks.

  Args:
    choices: non-root paths, e.g. [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]; must be
      prefix-closed (every path's parent path is present). Order does not matter.
    num_heads: if given, the tree depth must not exceed it.

  Returns:
    The tree, nodes ordered by depth then path (parents precede children).
  """
  paths = _validate_choices(choices)
  all_paths = ((),) + paths
  index = {p: i for i, p in enumerate(all_paths)}
  parent = [-1] + [index[p[:-1]] for p in paths]
  rank = [-1] + [p[-1] for p in paths]
  tree = _assemble(paths, parent, rank)
  if num_heads is not None:
    tree.check_num_heads(num_heads)
  return tree


def with_lookup(tree: Tree, length: int) -> Tree:
  """`tree` plus a chain of `length` prompt-lookup drafts below its root (greedy decoding).

  The lookup nodes come after the heads' nodes, node `tree.num_nodes` at depth 1 and each next
  one below the previous; the decoder fills them with the tokens that followed the latest
  earlier occurrence of the text's last few tokens (`lookup.propose`). Repetitive text (code
  that restates its names, prose that quotes its prompt) is where the heads guess worst and
  lookup best; verification accepts whichever path the trunk agrees with.
  """
  if tree.lookup_depth:
    raise ValueError(f'the tree already has a lookup chain of {tree.lookup_depth} nodes')
  if isinstance(length, bool) or int(length) != length or length < 1:
    raise ValueError(f'the lookup chain needs at least one node, got {length!r}')
  length = int(length)
  n = tree.num_nodes
  parent = list(tree.parent) + [0] + list(range(n, n + length - 1))
  rank = list(tree.rank) + [-1] * length
  return _assemble(tree.choices, parent, rank, lookup_depth=length)


def _assemble(choices: tuple[Path, ...], parent: Sequence[int], rank: Sequence[int],
              lookup_depth: int = 0) -> Tree:
  """The `Tree` of nodes given by parent and rank (parents precede children)."""
  parent = np.asarray(parent, np.int32)
  rank = np.asarray(rank, np.int32)
  n = len(parent)
  depth = np.zeros(n, np.int32)
  for i in range(1, n):
    depth[i] = depth[parent[i]] + 1
  max_depth = int(depth.max())

  kids = [[] for _ in range(n)]
  for i in range(1, n):
    kids[parent[i]].append(i)  # BFS order sorts siblings by rank already.
  num_children = np.array([len(k) for k in kids], np.int32)
  max_children = max(1, int(num_children.max()))
  children = np.full((n, max_children), -1, np.int32)
  for i, k in enumerate(kids):
    children[i, :len(k)] = k

  node_paths = np.full((n, max_depth + 1), -1, np.int32)
  attention_mask = np.zeros((n, n), bool)
  for i in range(n):
    ancestors = [i]
    while ancestors[-1]:
      ancestors.append(int(parent[ancestors[-1]]))
    ancestors.reverse()
    node_paths[i, :len(ancestors)] = ancestors
    attention_mask[i, ancestors] = True
  leaves = [i for i in range(n) if num_children[i] == 0]
  leaf_paths = node_paths[leaves]

  level_width = tuple(int(num_children[depth == d].max()) for d in range(max_depth))
  heads = slice(0, n - lookup_depth)
  topk_per_depth = tuple(
      int(rank[heads][depth[heads] == d].max()) + 1
      for d in range(1, int(depth[heads].max()) + 1))

  for a in (parent, depth, rank, attention_mask, children, num_children, node_paths, leaf_paths):
    a.flags.writeable = False  # Shared static structure: keep it immutable.
  return Tree(
      choices=choices, num_nodes=n, parent=parent, depth=depth, rank=rank,
      attention_mask=attention_mask, children=children, num_children=num_children,
      node_paths=node_paths, leaf_paths=leaf_paths, max_depth=max_depth,
      max_children=max_children, level_width=level_width, topk_per_depth=topk_per_depth,
      lookup_depth=lookup_depth)


def attention_order(tree: Tree) -> np.ndarray:
  """The order a verification pass lays the tree's nodes out in: its longest root-to-leaf path
  first (of equal ones, the first leaf's), then the other nodes in node order (parents still
  before children). [N] int32: block slot j holds node order[j].

  A node of that path sees a prefix of the block, so attention reads its keys with the
  committed ones instead of gathering them per query (`kv_cache.attend`, in half precision on
  CPU): in a block of the heads' tree and prompt lookup's chain (`join`), the chain is that
  path and only the heads' nodes are gathered.
  """
  depths = np.sum(tree.leaf_paths >= 0, axis=1)
  path = tree.leaf_paths[int(np.argmax(depths))]
  path = [int(node) for node in path[path >= 0]]
  on_path = set(path)
  return np.asarray(path + [i for i in range(tree.num_nodes) if i not in on_path], np.int32)


def chain_tree(k: int) -> Tree:
  """The chain of top-1 drafts of depth k: root -> (0,) -> (0, 0) -> ...; N = k + 1."""
  if k < 0:
    raise ValueError(f'chain length must be >= 0, got {k}')
  return tree_from_choices([(0,) * d for d in range(1, k + 1)])


# 24 nodes (root included), depth 4, top-5 at head 1. Built by `tree_from_accuracies(
# TYPICAL_HEAD_ACCURACIES, 24)` (a test checks it) from a typical profile of heads' top-k
# accuracies, each given that the earlier drafts were right. On a memory-bound accelerator a
# 24-token verification costs little more than one token; on CPU prefer `choose_tree_size`.
TYPICAL_HEAD_ACCURACIES = (
    (0.65, 0.12, 0.05, 0.03, 0.02),
    (0.60, 0.12, 0.05, 0.03, 0.02),
    (0.55, 0.11, 0.05, 0.03, 0.02),
    (0.50, 0.10, 0.05, 0.03, 0.02),
)
_MEDUSA_DEFAULT_CHOICES = (
    (0,), (1,), (2,), (3,), (4,),
    (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
)


def medusa_default_tree(num_heads: int | None = None) -> Tree:
  """A 24-node default static tree of depth 4; with num_heads < 4 it is cut to that depth."""
  choices = _MEDUSA_DEFAULT_CHOICES
  if num_heads is not None:
    if num_heads < 1:
      raise ValueError(f'num_heads must be >= 1, got {num_heads}')
    choices = tuple(p for p in choices if len(p) <= num_heads)
  return tree_from_choices(choices, num_heads=num_heads)


def _check_accuracies(accuracies) -> np.ndarray:
  acc = np.asarray(accuracies, np.float64)
  if acc.ndim != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
    raise ValueError(f'accuracies must have shape [num_heads, topk], got {acc.shape}')
  if not np.all((acc >= 0) & (acc <= 1)):
    raise ValueError('accuracies must lie in [0, 1]')
  return acc


def tree_from_accuracies(accuracies, num_nodes: int) -> Tree:
  """Best tree of num_nodes nodes under independent per-head accuracies (Medusa's construction).

  A node's score is the product of accuracies[d, r] along its path: the probability it is
  accepted if heads are right independently (exact when accuracies[d] is measured given that
  the earlier tokens were right, as on teacher-forced data; marginal accuracies of later heads
  understate deep paths). Best-first selection of the num_nodes - 1 highest
  scores maximises the expected accepted length; it is prefix-closed because a child never
  scores more than its parent and ties go to shorter, then lexicographically smaller, paths.

  Args:
    accuracies: [depth, R], accuracies[d, r] = P(rank-r candidate of head d + 1 is the next token).
    num_nodes: N, root included; must be between 1 and the number of possible nodes.

  Returns:
    The tree.
  """
  acc = _check_accuracies(accuracies)
  d_max, r_max = acc.shape
  total = sum(r_max ** d for d in range(1, d_max + 1))
  if not 1 <= num_nodes <= total + 1:
    raise ValueError(f'num_nodes must be in [1, {total + 1}] for accuracies of shape '
                     f'{acc.shape}, got {num_nodes}')
  # Heap of (-score, depth, path): deterministic ties, parents before children.
  heap = [(-acc[0, r], 1, (r,)) for r in range(r_max)]
  heapq.heapify(heap)
  chosen = []
  while len(chosen) < num_nodes - 1:
    neg, d, p = heapq.heappop(heap)
    chosen.append(p)
    if d < d_max:
      for r in range(r_max):
        heapq.heappush(heap, (neg * acc[d, r], d + 1, p + (r,)))
  return tree_from_choices(chosen)


def best_tree(accuracies, max_nodes: int) -> Tree:
  """`tree_from_accuracies` with `max_nodes` nodes, or every possible node where the
  accuracies' shape [depth, R] allows fewer (a superset for dynamic trees)."""
  acc = _check_accuracies(accuracies)
  possible = sum(acc.shape[1] ** d for d in range(1, acc.shape[0] + 1)) + 1
  return tree_from_accuracies(acc, min(max_nodes, possible))


def expected_accepted_length(tree: Tree, accuracies) -> float:
  """Expected number of accepted drafts per step (excluding the always-emitted next token).

  Sum over non-root nodes of the product of accuracies along the path; tokens per step is one
  more. Assumes heads are right independently (the same model as `tree_from_accuracies`).
  """
  acc = _check_accuracies(accuracies)
  if tree.lookup_depth:
    raise ValueError('expected_accepted_length models head drafts only, not a lookup chain')
  if tree.max_depth > acc.shape[0] or any(
      k > acc.shape[1] for k in tree.topk_per_depth):
    raise ValueError(f'tree needs top-k {tree.topk_per_depth} per head, accuracies have shape '
                     f'{acc.shape}')
  score = np.ones(tree.num_nodes)
  for n in range(1, tree.num_nodes):  # Parents precede children.
    score[n] = score[tree.parent[n]] * acc[tree.depth[n] - 1, tree.rank[n]]
  return float(score[1:].sum())


def choose_tree_size(accuracies,
                     cost_per_num_tokens: Mapping[int, float] | Callable[[int], float],
                     candidates: Sequence[int]) -> int:
  """Picks num_nodes maximising (1 + expected accepted drafts) / cost(num_nodes).

  Args:
    accuracies: [depth, R] per-head top-k accuracies, as for `tree_from_accuracies`.
    cost_per_num_tokens: cost of a verification forward over T tokens relative to T = 1, as a
      callable or a dict {T: cost}; a dict is interpolated linearly between its keys (it must
      cover every candidate).
    candidates: tree sizes N (root included; a forward verifies N tokens) to consider.

  Returns:
    The best candidate; ties go to the smaller tree.
  """
  if not candidates:
    raise ValueError('candidates must not be empty')
  if callable(cost_per_num_tokens):
    cost = cost_per_num_tokens
  else:
    ks = np.array(sorted(cost_per_num_tokens), np.float64)
    vs = np.array([cost_per_num_tokens[k] for k in sorted(cost_per_num_tokens)], np.float64)

    def cost(t):
      if not ks[0] <= t <= ks[-1]:
        raise ValueError(f'cost_per_num_tokens covers T in [{ks[0]:g}, {ks[-1]:g}], '
                         f'cannot price a tree of {t} tokens')
      return float(np.interp(t, ks, vs))

  best, best_value = None, -np.inf
  for n in sorted(set(int(c) for c in candidates)):
    tree = tree_from_accuracies(accuracies, n)
    c = float(cost(n))
    if not c > 0:
      raise ValueError(f'cost of {n} tokens must be positive, got {c}')
    value = (1.0 + expected_accepted_length(tree, accuracies)) / c
    if value > best_value * (1 + 1e-12):
      best, best_value = n, value
  return best


def parse(value: str | None) -> str | list[tuple[int, ...]] | None:
  """A tree given as text (a flag, a config value): None, a name of `NAMES` or JSON rank paths.

  Raises:
    ValueError naming the accepted forms.
  """
  if value is None or value in NAMES:
    return value
  try:
    choices = json.loads(value)
  except (json.JSONDecodeError, TypeError):
    raise ValueError(f'tree must be one of {", ".join(NAMES)} or JSON choices like '
                     f'"[[0], [1], [0, 0]]", got {value!r}') from None
  if not isinstance(choices, list) or not all(isinstance(c, list) for c in choices):
    raise ValueError(f'tree choices must be a JSON list of lists of ranks, got {value!r}')
  return [tuple(c) for c in choices]


def static_tree(choice, num_heads: int) -> Tree:
  """The heads' tree for a choice that needs no measurement, checked against the model's heads.

  Args:
    choice: None or 'chain' (every head's top-1 in a chain), 'default' (`medusa_default_tree`),
      an int k (a chain of k drafts), Medusa-style choices (or their JSON text), or a `Tree`.
    num_heads: the model's MTP heads.

  Raises:
    ValueError: the model has no heads, the name needs measuring ('auto', 'dynamic') or is
      unknown, or the tree is empty or deeper than the heads.
  """
  if num_heads == 0:
    raise ValueError('drafting with heads needs a model with MTP heads: this model has '
                     'mtp_num_heads=0')
  if choice is None or choice == CHAIN:
    return chain_tree(num_heads)
  if isinstance(choice, str):
    if choice == DEFAULT:
      return medusa_default_tree(num_heads)
    if choice in MEASURED:
      raise ValueError(f'tree={choice!r} is built from measurements of the model '
                       '(`mtp.decode.plan`), not a static tree')
    choice = parse(choice)  # JSON rank paths, as the --tree flag takes them.
  if isinstance(choice, numbers.Integral) and not isinstance(choice, bool):
    if choice < 1:
      raise ValueError(f'chain length must be >= 1, got {choice}')
    if choice > num_heads:
      raise ValueError(f'chain length {choice} exceeds the number of MTP heads {num_heads}')
    return chain_tree(int(choice))
  if not isinstance(choice, (Tree, Sequence)) or isinstance(choice, (bool, bytes)):
    raise ValueError(f'tree must be one of {", ".join(NAMES)}, a chain length, Medusa-style '
                     f'choices or a Tree, got {choice!r}')
  tree = choice if isinstance(choice, Tree) else tree_from_choices(choice)
  if tree.head_depth < 1:
    raise ValueError('the candidate tree has no drafted nodes')
  tree.check_num_heads(num_heads)
  return tree


def join(subtrees: Sequence[Tree]) -> tuple[Tree, np.ndarray]:
  """One block from several drafters' subtrees, each hung below the shared root in turn.

  Args:
    subtrees: each drafter's tree (its root is the block's root).

  Returns:
    (the block: a Tree whose nodes are the root, then every subtree's non-root nodes in order;
    owner [N] int32: the index of the subtree each node comes from, -1 for the root). A single
    subtree is returned as it is (a chain stays a chain). Nodes after the first subtree count
    as `lookup_depth` nodes (they are not the heads' ranks: `num_head_nodes` covers the first).
  """
  if len(subtrees) == 1:
    owner = np.zeros(subtrees[0].num_nodes, np.int32)
    owner[0] = -1
    return subtrees[0], owner
  parent, rank, owner = [-1], [-1], [-1]
  for index, sub in enumerate(subtrees):
    offset = len(parent) - 1
    for node in range(1, sub.num_nodes):
      p = int(sub.parent[node])
      parent.append(0 if p == 0 else p + offset)
      rank.append(int(sub.rank[node]) if index == 0 else -1)
      owner.append(index)
  first = subtrees[0]
  tree = _assemble(first.choices, parent, rank, lookup_depth=len(parent) - first.num_nodes)
  return tree, np.asarray(owner, np.int32)
