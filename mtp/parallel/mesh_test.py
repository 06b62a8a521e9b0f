"""Mesh shapes: -1 fills the devices left over; a mesh or batch that does not fit is named."""

import pytest

from mtp.parallel import mesh as mesh_lib


@pytest.mark.parametrize('sizes,num_devices,expected', [
    ((2, 2, 2), 8, (2, 2, 2)),
    ((-1, 2, 2), 8, (2, 2, 2)),
    ((1, -1, 2), 8, (1, 4, 2)),
    ((1, 1, 1), 8, (1, 1, 1)),  # A divisor: the first device only.
    ((4, 1, 1), 8, (4, 1, 1)),
    ((-1, 4, 8), 32, (1, 4, 8)),
])
def test_resolve_mesh_shape(sizes, num_devices, expected):
  config = dict(zip(mesh_lib.MESH_AXES, sizes))
  assert mesh_lib.resolve_mesh_shape(config, num_devices) == expected


@pytest.mark.parametrize('sizes,num_devices,message', [
    ((3, 1, 1), 8, r'Mesh data=3 x fsdp=1 x tensor=1 \(3 devices\) does not divide the 8 '
                   r'devices.*mesh.data=-1'),
    ((-1, 3, 1), 8, r'Mesh data=-1 x fsdp=3 x tensor=1 does not divide the 8 devices.*'
                    r'divisor of 8'),
    ((4, 4, 1), 8, r'Mesh data=4 x fsdp=4 x tensor=1 needs 16 devices, but 8 are available'),
    ((-1, -1, 2), 8, r'at most one axis may be -1'),
    ((0, 1, 1), 8, r'axis sizes must be positive'),
])
def test_a_mesh_that_does_not_fit_the_devices_is_named(sizes, num_devices, message):
  with pytest.raises(mesh_lib.MeshError, match=message):
    mesh_lib.resolve_mesh_shape(dict(zip(mesh_lib.MESH_AXES, sizes)), num_devices)


def test_a_batch_that_does_not_divide_the_batch_axes_is_named():
  mesh_lib.check_batch_fits(8, (2, 2, 2))
  mesh_lib.check_batch_fits(4, (1, 4, 2))
  with pytest.raises(mesh_lib.MeshError, match=r'data.batch_size \(6\) does not divide over '
                     r'the mesh data=1 x fsdp=4 x tensor=2.*multiple of 4'):
    mesh_lib.check_batch_fits(6, (1, 4, 2))


def test_constrain_batch_splits_rows_only_within_activations_on():
  import jax
  import jax.numpy as jnp

  if jax.device_count() < 8:
    pytest.skip('needs 8 devices (conftest.py simulates them on CPU)')
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=4, tensor=1))

  def rows_split(x):
    with mesh_lib.activations_on(mesh):
      return mesh_lib.constrain_batch(x * 2, row_axis=1)
  out = jax.jit(rows_split)(jnp.ones((3, 16, 5)))
  assert out.sharding.spec == jax.sharding.PartitionSpec(None, ('data', 'fsdp'))
  x = jnp.ones((16, 5))
  assert mesh_lib.constrain_batch(x) is x  # Outside: unchanged.
  with mesh_lib.activations_on(mesh):
    odd = jnp.ones((6, 5))  # 6 rows do not divide over 8 devices.
    assert mesh_lib.constrain_batch(odd) is odd
