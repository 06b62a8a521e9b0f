"""Fingerprints change with any one flipped bit, and not with where an array lies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.checkpoint import fingerprint
from mtp.parallel import mesh as mesh_lib


@pytest.mark.parametrize('dtype', [np.float32, np.int32, jnp.bfloat16, np.uint8, np.bool_])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
  rng = np.random.default_rng(0)
  x = np.asarray(rng.normal(size=(3, 5)) > 0 if dtype == np.bool_ else
                 rng.normal(size=(3, 5)) * 100, dtype)
  base = fingerprint.fingerprints({'x': x})['x']
  bits = x.view(np.uint8).copy() if dtype != np.bool_ else x.astype(np.uint8)
  flat = bits.reshape(-1)
  for byte in range(flat.size):
    for bit in range(1 if dtype == np.bool_ else 8):
      flipped = flat.copy()
      flipped[byte] ^= 1 << bit
      y = flipped.astype(bool) if dtype == np.bool_ else flipped.view(x.dtype)
      assert fingerprint.fingerprints({'x': y.reshape(x.shape)})['x'] != base, (byte, bit)


def test_a_sharded_array_has_the_fingerprint_of_its_values():
  mesh = jax.make_mesh((2, 4), ('data', 'tensor'))
  x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) / 7
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P('data', 'tensor')))
  assert not sharded.sharding.is_fully_replicated
  tree = {'a': {'b': [sharded, np.float32(1.5)]}}
  plain = {'a': {'b': [x, np.float32(1.5)]}}
  assert fingerprint.fingerprints(tree) == fingerprint.fingerprints(plain)
  assert set(fingerprint.fingerprints(tree)) == {'a/b/0', 'a/b/1'}
  assert fingerprint.mismatches({'a': {'b': [x + 1, np.float32(1.5)]}},
                                fingerprint.fingerprints(tree)) == [
      'a/b/0']
