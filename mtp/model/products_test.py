"""Half-precision products on XLA:CPU's fast path give the sums a plain product rounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.model import mtp_model
from mtp.model import products
from mtp.model import testing
from mtp.model import transformer


def _operands(rows_shape, dtype, k=24, n=40, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=rows_shape + (k,)), dtype)
  w = jnp.asarray(rng.normal(size=(k, n)), dtype)
  return x, w


def _reference(x, w, preferred=None):
  """The float32 sums of the product, rounded to the result type a plain product has."""
  exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  return np.asarray(jnp.asarray(exact).astype(preferred or jnp.result_type(x, w)))


@pytest.mark.parametrize('rows_shape', [(1,), (1, 1), (1, 1, 1), (3,), (2, 5)])
@pytest.mark.parametrize('preferred', [None, jnp.float32])
def test_half_precision_products_equal_the_rounded_float32_sums(rows_shape, preferred):
  x, w = _operands(rows_shape, jnp.bfloat16)
  out = products.einsum('...d,df->...f', x, w, preferred_element_type=preferred)
  general = products.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                                 preferred_element_type=preferred)
  for got in (out, general):
    assert got.shape == rows_shape + (w.shape[1],)
    assert got.dtype == (preferred or jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(_reference(x, w, preferred), np.float32),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize('k, n', [(64, 96), (576, 960)])
def test_a_row_has_the_same_bits_in_any_block_of_rows(k, n):
  """The claim decoding's exactness in half precision rests on (a property of XLA:CPU's
  kernel, kept here so that an upgrade that breaks it fails a test): a row's product, alone
  (padded) or in blocks of 2 to 64 rows, has the same bits."""
  x, w = _operands((64,), jnp.bfloat16, k=k, n=n)
  product = jax.jit(lambda x: products.einsum('...d,df->...f', x, w,
                                              preferred_element_type=jnp.float32))
  alone = np.stack([np.asarray(product(x[i:i + 1]))[0] for i in (0, 1, 2, 37)])
  for rows in (2, 3, 4, 8, 38, 64):
    block = np.asarray(product(x[:rows]))
    kept = [j for j, i in enumerate((0, 1, 2, 37)) if i < rows]
    np.testing.assert_array_equal(block[[(0, 1, 2, 37)[j] for j in kept]], alone[kept])


def test_a_row_sum_in_fixed_order_has_the_same_bits_in_any_block():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 8, 131)), jnp.float32)
  total = jax.jit(products.ordered_sum)
  block = np.asarray(total(x))
  for t in range(8):
    np.testing.assert_array_equal(np.asarray(total(x[:, t:t + 1]))[:, 0], block[:, t])
  np.testing.assert_allclose(block, np.asarray(x).sum(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(products.ordered_sum(x[..., :1], keepdims=True), x[..., :1])


def test_float32_products_are_plain_products():
  x, w = _operands((1, 1), jnp.float32)
  np.testing.assert_array_equal(products.einsum('...d,df->...f', x, w),
                                jnp.einsum('...d,df->...f', x, w))
  dims = (((2,), (0,)), ((), ()))
  np.testing.assert_array_equal(products.dot_general(x, w, dims),
                                jax.lax.dot_general(x, w, dims))


@pytest.mark.parametrize('head_type', ['medusa', 'eagle', 'sequential', 'parallel'])
def test_every_linear_layer_of_the_model_runs_its_products_here(head_type):
  """The fast path holds only if no projection bypasses it: a new `nnx.Linear` must name
  `products.dot_general` (decoding's fused copy uses `products.einsum`)."""
  cfg = testing.tiny_config(head_type=head_type)
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
  assert linears
  for linear in linears:
    assert linear.dot_general is products.dot_general, linear
  fused = transformer.fused_projections(model)
  assert any(isinstance(m, transformer.FusedLinear) for _, m in nnx.iter_modules(fused))
