"""The trunk's two parameter layouts and the pure conversions between them.

  * unrolled (`model.scan_layers=False`): one subtree per layer, `trunk/blocks/{i}/...`;
  * scanned (`model.scan_layers=True`): one subtree whose every array has a leading layer axis
    [L, ...], `trunk/blocks/...` (what `jax.lax.scan` runs over).

The conversions work on nested dicts and lists (`nnx.to_pure_dict` trees, checkpoint metadata,
optimizer states: any tree holding a `trunk` node with `blocks` under it, at any depth) whose
leaves are numpy or JAX arrays or `jax.ShapeDtypeStruct`s. Layer keys may be ints or digit
strings (Orbax names them '0', '1', ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

TRUNK, BLOCKS = 'trunk', 'blocks'
SCANNED, UNROLLED = 'scanned', 'unrolled'


class LayoutMismatchError(ValueError):
  """A checkpoint in one layer layout was asked into a model of the other, without conversion."""


def layout_name(scan_layers: bool) -> str:
  return SCANNED if scan_layers else UNROLLED


def _is_layer_key(key) -> bool:
  return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def blocks_layout(blocks: Mapping[Any, Any]) -> str:
  """SCANNED or UNROLLED for a `trunk/blocks` node (unrolled: its keys are layer indices)."""
  keys = list(blocks)
  if not keys:
    raise ValueError('The trunk has no blocks.')
  return UNROLLED if all(_is_layer_key(k) for k in keys) else SCANNED


def tree_layout(tree: Mapping[Any, Any]) -> str | None:
  """The layout of the first `trunk/blocks` node found in `tree`, or None when it has none."""
  for blocks in _blocks_nodes(tree):
    return blocks_layout(blocks)
  return None


def _blocks_nodes(tree):
  if isinstance(tree, (list, tuple)):
    for child in tree:
      yield from _blocks_nodes(child)
  if not isinstance(tree, Mapping):
    return
  trunk = tree.get(TRUNK)
  if isinstance(trunk, Mapping) and isinstance(trunk.get(BLOCKS), Mapping):
    yield trunk[BLOCKS]
  for key, child in tree.items():
    if key != TRUNK:
      yield from _blocks_nodes(child)


def _with_layer_axis(sharding, add: bool):
  """A NamedSharding with an unsharded layer axis added in front (or removed); others as they
  are (a single device's sharding fits any rank)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  spec = (None,) + spec if add else spec[1:]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def _stack_leaves(*leaves):
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    sharding = getattr(first, 'sharding', None)
    return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype,
                                sharding=_with_layer_axis(sharding, add=True))
  if isinstance(first, jax.Array):
    return jnp.stack(leaves)
  return np.stack([np.asarray(x) for x in leaves])


def _layer_of(leaf, i: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sharding = getattr(leaf, 'sharding', None)
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype,
                                sharding=_with_layer_axis(sharding, add=False))
  return leaf[i]


def stack_layers(layers: Mapping[Any, Any]) -> Any:
  """{0: tree, 1: tree, ...} (L per-layer trees of one structure) -> one tree of [L, ...] leaves.

  Raises:
    ValueError: the keys are not the layer indices 0..L-1, or the layers differ in structure.
  """
  indices = sorted(int(k) for k in layers)
  if indices != list(range(len(indices))) or not indices:
    raise ValueError(f'Layer keys must be 0..L-1, got {sorted(layers, key=str)}.')
  by_index = {int(k): v for k, v in layers.items()}
  ordered = [by_index[i] for i in indices]
  structure = jax.tree.structure(ordered[0])
  for i, layer in enumerate(ordered):
    if jax.tree.structure(layer) != structure:
      raise ValueError(f'Layer {i} has another structure than layer 0: {jax.tree.structure(layer)}'
                       f' vs {structure}.')
  return jax.tree.map(_stack_leaves, *ordered,
                      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def unstack_layers(stacked: Any, key_type=int) -> dict[Any, Any]:
  """One tree of [L, ...] leaves -> {0: tree, ..., L-1: tree}; keys as `key_type` (int or str).

  Raises:
    ValueError: the leaves disagree on L.
  """
  is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
  sizes = {int(leaf.shape[0]) for leaf in jax.tree.leaves(stacked, is_leaf=is_leaf)}
  if len(sizes) != 1:
    raise ValueError(f'Stacked layers disagree on the layer count: {sorted(sizes)}.')
  count = sizes.pop()
  return {key_type(i): jax.tree.map(lambda x, i=i: _layer_of(x, i), stacked, is_leaf=is_leaf)
          for i in range(count)}


def to_layout(tree: Mapping[Any, Any], scan_layers: bool, layer_key=int) -> dict[Any, Any]:
  """`tree` with every `trunk/blocks` node in the given layout (converted where it is not).

  Pure: returns new dicts, leaves `tree` as it was. Unstacked layers are keyed `layer_key(i)`
  (int, as `nnx.to_pure_dict` keys list entries; str for checkpoint paths).
  """
  want = layout_name(scan_layers)

  def convert(node):
    if type(node) in (list, tuple):  # Optimizer states restored from their metadata.
      return type(node)(convert(child) for child in node)
    if not isinstance(node, Mapping):
      return node
    out = {key: (convert(child) if key != TRUNK else child) for key, child in node.items()}
    trunk = node.get(TRUNK)
    if isinstance(trunk, Mapping):
      trunk = {key: convert(child) if key != BLOCKS else child for key, child in trunk.items()}
      blocks = trunk.get(BLOCKS)
      if isinstance(blocks, Mapping) and blocks_layout(blocks) != want:
        if scan_layers:
          trunk[BLOCKS] = stack_layers(blocks)
        else:
          trunk[BLOCKS] = unstack_layers(blocks, layer_key)
      out[TRUNK] = trunk
    return out
  return convert(tree)


def nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
  """{('a', 'b'): x} -> {'a': {'b': x}}."""
  out: dict[str, Any] = {}
  for path, leaf in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def flatten(tree: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
  """`nest`'s inverse: {'a': {'b': x}} -> {('a', 'b'): x} (keys as strings)."""
  out = {}

  def walk(node, prefix):
    for key, child in node.items():
      if isinstance(child, Mapping):
        walk(child, prefix + (str(key),))
      else:
        out[prefix + (str(key),)] = child
  walk(tree, ())
  return out


def mismatch_message(what: str, saved: str, wanted: str, workdir=None) -> str:
  """How to go on when `what` (of `workdir`) holds layers in layout `saved` and the model wants
  `wanted`."""
  return (f'{what} holds the trunk\'s layers {saved} but the model is configured {wanted} '
          f'(model.scan_layers={wanted == SCANNED}). Resume with '
          f'--config.model.scan_layers={saved == SCANNED}, or convert the workdir: '
          f'python -m launch.convert_layout --workdir={workdir or "<this workdir>"} '
          f'--output=<new workdir> --scan_layers={wanted == SCANNED} '
          f'(mtp.model.layout.to_layout converts a parameter tree in Python).')


def with_layout(model, scan_layers: bool):
  """The `mtp_model.MTPModel` `model` in the given layer layout: the same weights, its trunk's
  layers stacked or unstacked (the model itself when it already has that layout)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from mtp.model import mtp_model  # pylint: disable=import-outside-toplevel
  cfg = model.cfg
  if cfg.trunk.scan_layers == scan_layers:
    return model
  new_cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk,
                                                               scan_layers=scan_layers))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: mtp_model.MTPModel(new_cfg,
                                                                         rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, to_layout(nnx.to_pure_dict(nnx.state(model)), scan_layers))
  return nnx.merge(graphdef, state)
