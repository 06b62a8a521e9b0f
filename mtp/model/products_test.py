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


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
  """The operand dtypes of every dot_general in a jaxpr, nested ones (custom rules) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for sub in jax.core.jaxprs_in_params(eqn.params):
      found.extend(_dot_operand_dtypes(sub))
  return found


@pytest.mark.parametrize('product', ['linear', 'logits'])
def test_gradients_of_half_precision_products_are_half_precision_products(product):
  """Training's backward pass stays on the fast kernel: both gradients of a linear layer and of
  the logits are bfloat16 products (left to JAX, each would read a float32 cotangent, and
  XLA:CPU would run it in float32 at about half the speed), and they are the float32 gradients
  to bfloat16's rounding."""
  x, w = _operands((4, 6), jnp.bfloat16, k=64, n=96)
  w = w / 8
  if product == 'linear':
    apply = lambda x, w: products.dot_general(x, w, (((2,), (0,)), ((), ())))
  else:
    apply = lambda x, w: products.einsum('...d,nd->...n', x, w.T,
                                         preferred_element_type=jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))
  grad = jax.grad(loss(apply), argnums=(0, 1))
  dots = _dot_operand_dtypes(jax.make_jaxpr(grad)(x, w).jaxpr)
  assert len(dots) == 3, dots  # The product and its two gradients.
  assert all(dtypes == ('bfloat16', 'bfloat16') for dtypes in dots), dots
  reference = jax.grad(loss(lambda x, w: jnp.einsum('btd,dn->btn', x.astype(jnp.float32),
                                                    w.astype(jnp.float32))), argnums=(0, 1))
  for got, want in zip(grad(x, w), reference(x, w)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0.02,
                               atol=0.02 * float(jnp.max(jnp.abs(want))))


def test_a_product_and_its_gradients_through_an_nnx_linear_layer():
  """What training differentiates: a bfloat16 `nnx.Linear` over float32 weights (as the model's
  layers are) gets a float32 weight gradient near the float32 layer's."""
  linear = nnx.Linear(64, 32, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                      dot_general=products.dot_general, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 64)), jnp.bfloat16)
  loss = lambda model, x: jnp.sum(jnp.sin(model(x).astype(jnp.float32)))
  grads = nnx.grad(loss)(linear, x)
  kernel = linear.kernel[...]
  want = jax.grad(lambda k: jnp.sum(jnp.sin(x.astype(jnp.float32) @ k)))(kernel)
  assert grads.kernel[...].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(grads.kernel[...]), np.asarray(want), rtol=0.05,
                             atol=0.02 * float(jnp.max(jnp.abs(want))))


def test_remat_keeping_matmul_outputs_keeps_these_products(capsys):
  """`dots_saveable` cannot see a matmul inside a custom VJP; `SAVE_DOTS` (the trunk's
  'dots_saveable' remat) keeps the fast path's products by name, as it keeps plain matmuls."""
  x, w = _operands((8,), jnp.bfloat16, k=64, n=32)
  loss = lambda x, w: jnp.sum(jnp.sin(products.dot_general(x, w, (((1,), (0,)), ((), ())))
                                      .astype(jnp.float32)))
  for policy, kept in ((jax.checkpoint_policies.dots_saveable, False), (products.SAVE_DOTS, True)):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), x, w)
    assert (products.PRODUCT_NAME in capsys.readouterr().out) == kept
