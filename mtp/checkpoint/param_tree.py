"""The two parts of an MTP model's parameters, by their top-level key: the trunk and the heads.

Every split or merge of a parameter tree by part goes through here: checkpoints of heads alone,
a pretrained trunk under new heads, the optimizer's parameter groups.
"""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

TRUNK, HEADS = 'trunk', 'heads'


def labels(params: nnx.State) -> nnx.State:
  """The tree of `params` with each leaf replaced by its part's name, 'trunk' or 'heads'."""
  def label(path, _):
    return HEADS if path and getattr(path[0], 'key', path[0]) == HEADS else TRUNK
  return jax.tree_util.tree_map_with_path(label, params)


def select(params: nnx.State, parts: Sequence[str]) -> nnx.State:
  """The given parts of `params` (concrete or abstract), as a state of their own (with the same
  node types as `params`, so that its tree is a subtree of theirs)."""
  return nnx.State({part: params.raw_mapping[part] for part in parts})


def replace(params: nnx.State, parts: nnx.State) -> nnx.State:
  """`params` (updated in place) with each part that `parts` holds taken from there."""
  values = nnx.to_pure_dict(params)
  values.update(nnx.to_pure_dict(parts))
  nnx.replace_by_pure_dict(params, values)
  return params
