"""Device mesh (data, fsdp, tensor), logical-axis rules, and sharding helpers.

Parameters carry logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'norm'); the
rules below map them onto mesh axes, MaxText-style. A dimension that the mapped mesh axes do not
divide stays replicated rather than failing, so small test models run on any mesh.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')

# Logical axis -> mesh axes. FSDP shards the width of every matrix; tensor parallelism the
# heads, MLP and vocabulary dimensions.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', BATCH_AXES),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('norm', None),
)


def resolve_mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Sizes of (data, fsdp, tensor); one entry may be -1 for the devices left over.

  Fixed sizes whose product is below `num_devices` use only the first devices.
  """
  sizes = [int(mesh_config[axis]) for axis in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f'At most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}.')
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f'Mesh axis sizes must be positive or -1, got '
                     f'{dict(zip(MESH_AXES, sizes))}.')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f'{num_devices} devices cannot be split into a mesh with fixed axes '
                       f'{dict(zip(MESH_AXES, sizes))}.')
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) > num_devices:
    raise ValueError(f'Mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, '
                     f'but {num_devices} are available.')
  return tuple(sizes)


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over all (or the given) devices with axes (data, fsdp, tensor)."""
  devices = list(devices if devices is not None else jax.devices())
  shape = resolve_mesh_shape(mesh_config, len(devices))
  if math.prod(shape) < len(devices):
    logging.info('Mesh %s uses %d of %d devices.', shape, math.prod(shape), len(devices))
    devices = devices[:math.prod(shape)]
  if devices == list(jax.devices()):
    # Auto axes: shardings propagate through jit as in GSPMD (jax.make_mesh now defaults to
    # explicit axes).
    return jax.make_mesh(shape, MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_mesh_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                         rules=DEFAULT_RULES) -> P:
  """Maps logical axis names of an array of `shape` to a mesh PartitionSpec."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name, dim in zip(logical, shape):
    axes = table.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if not axes or dim % size:
      if axes:
        logging.log_first_n(logging.INFO, 'Replicating a dimension of size %d over %s.', 10,
                            dim, axes)
      out.append(None)
      continue
    used.update(axes)
    out.append(axes[0] if len(axes) == 1 else axes)
  return P(*out)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for an nnx.State (abstract or concrete) from its logical axis metadata."""
  specs = nnx.get_partition_spec(state)

  def one(spec, leaf):
    logical = tuple(spec) if isinstance(spec, P) else ()
    logical = logical + (None,) * (len(leaf.shape) - len(logical))
    return NamedSharding(mesh, logical_to_mesh_spec(logical, leaf.shape, mesh, rules))
  return jax.tree.map(one, specs, state, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over the data and fsdp axes, everything else replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Places this process's rows of a global batch on the mesh (multi-host aware)."""
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

