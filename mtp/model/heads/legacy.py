"""Parameter paths of checkpoints written before the head families named their lists `layers`.

Old layouts under a `heads` node (K heads, k = 0..K-1):
  * medusa:   heads/heads/{k}/{j}/...                 now heads/layers/{k}/blocks/{j}/...
  * parallel: heads/blocks/{k}/..., heads/norms/{k}/... now heads/layers/{k}/block/...,
              heads/layers/{k}/norm/...
  * sequential: heads/layers/{k}/... (unchanged).

Trees are nested containers as Orbax restores them raw: dicts keyed by str (list indices as
str digits or ints), or lists. Optimizer states mirror the parameter tree, so every `heads`
node at any depth is upgraded.
"""

from __future__ import annotations

from typing import Any


def _children(node) -> list[tuple[Any, Any]]:
  if isinstance(node, dict):
    return list(node.items())
  if isinstance(node, (list, tuple)):
    return list(enumerate(node))
  return []


def _like(template, items: list[tuple[Any, Any]]):
  """A container of `template`'s kind holding `items` (ordered by key for sequences)."""
  if isinstance(template, (list, tuple)):
    return type(template)(value for _, value in sorted(items, key=lambda kv: int(kv[0])))
  return dict(items)


def _legacy_kind(node) -> str | None:
  """'medusa' or 'parallel' for an old-layout `heads` node, None otherwise."""
  if not isinstance(node, dict):
    return None
  if 'heads' in node and 'layers' not in node:
    return 'medusa'
  if ('blocks' in node or 'norms' in node) and 'layers' not in node:
    return 'parallel'
  return None


def _upgrade_heads(node, kind: str):
  if kind == 'medusa':
    old = node['heads']
    layers = [(k, {'blocks': blocks}) for k, blocks in _children(old)]
    new = {key: value for key, value in node.items() if key != 'heads'}
    new['layers'] = _like(old, layers)
    return new
  template = node.get('blocks', node.get('norms'))
  per_head: dict[Any, dict[str, Any]] = {}
  for old_name, new_name in (('blocks', 'block'), ('norms', 'norm')):
    for k, child in _children(node.get(old_name, {})):
      per_head.setdefault(k, {})[new_name] = child
  new = {key: value for key, value in node.items() if key not in ('blocks', 'norms')}
  new['layers'] = _like(template, list(per_head.items()))
  return new


def upgrade_legacy_tree(tree):
  """`tree` with every old-layout `heads` node renamed to the `layers` layout (a new tree;
  leaves are shared, not copied). Trees already in the new layout come back equal."""
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      kind = _legacy_kind(value) if key == 'heads' else None
      out[key] = _upgrade_heads(value, kind) if kind else upgrade_legacy_tree(value)
    return out
  if isinstance(tree, (list, tuple)):
    return type(tree)(upgrade_legacy_tree(value) for value in tree)
  return tree


def is_legacy_tree(tree) -> bool:
  """Whether any `heads` node in `tree` has an old layout."""
  for key, value in _children(tree):
    if key == 'heads' and _legacy_kind(value):
      return True
    if is_legacy_tree(value):
      return True
  return False
