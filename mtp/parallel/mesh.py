"""Device mesh (data, fsdp, tensor), logical-axis rules, and sharding helpers.

Parameters carry logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'norm', and
'layers' for a scanned trunk's stacked layers); the
rules below map them onto mesh axes, MaxText-style. A dimension that the mapped mesh axes do not
divide stays replicated rather than failing, so small test models run on any mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
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
    ('layers', None),  # the stacked layer axis of scanned trunks (model.scan_layers): each
                       # device holds every layer of its shard
)


class MeshError(ValueError):
  """A mesh that does not fit the devices, or a batch that does not fit the mesh."""


def _describe(sizes: Sequence[int]) -> str:
  return ' x '.join(f'{axis}={size}' for axis, size in zip(MESH_AXES, sizes))


def resolve_mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Sizes of (data, fsdp, tensor); one entry may be -1 for the devices left over.

  Fixed sizes whose product divides `num_devices` but is below it use only the first devices
  (a one-device mesh on a larger host, say).

  Raises:
    MeshError: the sizes are invalid, or their product does not divide `num_devices` (the
      message names the mesh, the device count and the fix).
  """
  sizes = [int(mesh_config[axis]) for axis in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise MeshError(f'Mesh {_describe(sizes)}: at most one axis may be -1 (the devices left '
                    'over); give the others fixed sizes.')
  if any(s == 0 or s < -1 for s in sizes):
    raise MeshError(f'Mesh {_describe(sizes)}: axis sizes must be positive, or -1 for the '
                    'devices left over.')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise MeshError(
          f'Mesh {_describe(sizes)} does not divide the {num_devices} devices: its fixed axes '
          f'span {known} devices, which does not divide {num_devices}. Make the product of the '
          f'fixed axes a divisor of {num_devices} (--config.mesh.AXIS=N).')
    sizes[sizes.index(-1)] = num_devices // known
  total = math.prod(sizes)
  if total > num_devices:
    raise MeshError(
        f'Mesh {_describe(sizes)} needs {total} devices, but {num_devices} are available. '
        f'Choose sizes whose product divides {num_devices}, or set one axis to -1 '
        '(--config.mesh.data=-1) to use the devices there are.')
  if num_devices % total:
    raise MeshError(
        f'Mesh {_describe(sizes)} ({total} devices) does not divide the {num_devices} devices. '
        f'Choose sizes whose product divides {num_devices}, or set one axis to -1 '
        '(--config.mesh.data=-1) to use all of them.')
  return tuple(sizes)


def check_batch_fits(batch_size: int, mesh_shape: Sequence[int]) -> None:
  """Raises MeshError unless the global batch splits evenly over the batch axes of a mesh of
  `mesh_shape` (data, fsdp, tensor)."""
  shape = dict(zip(MESH_AXES, mesh_shape))
  shards = math.prod(shape[axis] for axis in BATCH_AXES)
  if batch_size % shards:
    raise MeshError(
        f'data.batch_size ({batch_size}) does not divide over the mesh '
        f'{_describe(mesh_shape)}: its rows are split over data x fsdp = {shards} shards. Make '
        f'the batch size a multiple of {shards}, or change mesh.data / mesh.fsdp.')


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
  """NamedShardings for an nnx.State (abstract or concrete), or an optimizer state over one,
  from its logical axis metadata."""
  specs = nnx.get_partition_spec(state)

  def one(spec, leaf):
    if not hasattr(leaf, 'shape'):  # An empty node (optax's MaskedNode): no array to place.
      return leaf
    logical = tuple(spec) if isinstance(spec, P) else ()
    logical = logical + (None,) * (len(leaf.shape) - len(logical))
    return NamedSharding(mesh, logical_to_mesh_spec(logical, leaf.shape, mesh, rules))
  return jax.tree.map(one, specs, state, is_leaf=lambda x: isinstance(x, P))


# The mesh whose batch axes split the activations' rows while a train or eval step is traced
# (`activations_on`); None elsewhere (decoding, one device).
_ACTIVATION_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    'activation_mesh', default=None)


@contextlib.contextmanager
def activations_on(mesh: Mesh):
  """Within: `constrain_batch` splits activations' rows over `mesh`'s batch axes (trace time)."""
  token = _ACTIVATION_MESH.set(mesh)
  try:
    yield
  finally:
    _ACTIVATION_MESH.reset(token)


def constrain_batch(x: jax.Array, row_axis: int = 0) -> jax.Array:
  """x [B, ...] (rows on `row_axis`) with its rows split over the batch axes of the mesh of
  `activations_on`.

  Without it, XLA may resolve a matmul against FSDP-sharded weights (sharded on their input
  width) by splitting the contraction instead of the rows: every device then holds and computes
  the whole global batch's activations (measured: the MLP's [L, B, T, F] activations whole on
  each of 8 devices, 4.5x the temporaries). Outside `activations_on`, or where the rows do not
  divide, x is unchanged.
  """
  mesh = _ACTIVATION_MESH.get()
  if mesh is None:
    return x
  axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
  if not axes or x.shape[row_axis] % math.prod(mesh.shape[a] for a in axes):
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*(None,) * row_axis, axes)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over the data and fsdp axes, everything else replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Places this process's rows of a global batch on the mesh (multi-host aware)."""
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

