"""Matrix products that keep XLA:CPU on its fast, row-invariant half-precision kernel.

On XLA:CPU a bfloat16 (or float16) product whose sums accumulate in float32 and whose left
operand has 3 rows or more runs a kernel that is fast (2 to 16 rows cost about one float32 row;
8 rows about half of float32's 8) and row-invariant: each row's result has the same bits
whatever the other rows are and however many (measured to 256 rows; `products_test` keeps the
claim). With one or two rows, or with a half-precision result, XLA takes other paths: up to 9x
slower than float32, and with other bits.

So on CPU, half-precision products here accumulate in float32 and round the result to the
inputs' type (what a half-precision product rounds), and a left operand of fewer than 3 rows
gets zero rows up to `MIN_ROWS` whose results are dropped. A one-token decoding step then
computes every product bit for bit as a verification block does, so speculative decoding in
bfloat16 equals its own autoregressive decoding exactly. Float32 products and other backends
are left as they are.

Training differentiates these products on the same kernel. Left to JAX, the gradient's
products read the float32 cotangent against a half-precision operand, which XLA:CPU runs as a
float32 product at about half the speed; here the cotangent is rounded to the operands' type
first (mixed precision's half-precision gradients; exact where the product's result was
rounded so too), and both gradient products take the fast kernel.
"""

from __future__ import annotations

import functools
import math
import string
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The name (`jax.ad_checkpoint.checkpoint_name`) of every product's result on the fast path:
# a custom VJP hides its matmul from `jax.checkpoint_policies.dots_saveable`, so remat policies
# that keep matmul outputs save these by name too (`SAVE_DOTS`).
PRODUCT_NAME = 'half_precision_product'
ROW_INVARIANT_ROWS = 3  # The fewest left rows that take the row-invariant kernel.
MIN_ROWS = 4  # Fewer than ROW_INVARIANT_ROWS are padded to this (4 measured faster than 3).


# `jax.checkpoint_policies.dots_saveable` with this module's products kept as well.
SAVE_DOTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(PRODUCT_NAME))


def on_fast_path(dtype) -> bool:
  """Whether products of this input dtype run here on the padded, float32-accumulated path."""
  return jnp.dtype(dtype) in _HALF and jax.default_backend() == 'cpu'


def padded_rows(x: Array, axis: int) -> Array:
  """x with zero rows appended along `axis` up to MIN_ROWS where it has fewer than
  ROW_INVARIANT_ROWS (slice the product's rows back to x's)."""
  m = x.shape[axis]
  if m >= ROW_INVARIANT_ROWS:
    return x
  shape = list(x.shape)
  shape[axis] = MIN_ROWS - m
  return jnp.concatenate([x, jnp.zeros(shape, x.dtype)], axis)


def _by_rows(fn: Callable[[Array], Array], x: Array, dtype) -> Array:
  """fn(x) for a product `fn` over x's last axis whose result's leading axes are x's [...],
  run as one [M, D] operand of at least ROW_INVARIANT_ROWS rows, rounded to `dtype`."""
  lead = x.shape[:-1]
  rows = x.reshape(-1, x.shape[-1])
  out = checkpoint_name(fn(padded_rows(rows, 0)), PRODUCT_NAME)[:rows.shape[0]]
  return out.reshape(lead + out.shape[1:]).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rows_product(spec: str, precision, rows: Array, w: Array) -> Array:
  """einsum(spec, rows, w) with float32 sums and result: rows [M, D] in half precision, spec of
  the form 'md,<w>->m<out>'."""
  return jnp.einsum(spec, rows, w, precision=precision, preferred_element_type=jnp.float32)


def _rows_product_forward(spec, precision, rows, w):
  return _rows_product(spec, precision, rows, w), (rows, w)


def _rows_product_backward(spec, precision, residuals, cotangent):
  """Both gradients as half-precision products with float32 sums (the fast kernel)."""
  rows, w = residuals
  inputs, out = spec.split('->')
  rows_spec, w_spec = inputs.split(',')
  cotangent = cotangent.astype(rows.dtype)
  product = functools.partial(jnp.einsum, precision=precision,
                              preferred_element_type=jnp.float32)
  rows_gradient = product(f'{out},{w_spec}->{rows_spec}', cotangent, w.astype(rows.dtype))
  w_gradient = product(f'{rows_spec},{out}->{w_spec}', rows, cotangent)
  return rows_gradient.astype(rows.dtype), w_gradient.astype(w.dtype)


_rows_product.defvjp(_rows_product_forward, _rows_product_backward)


def _rows_spec(spec: str, w_ndim: int) -> str:
  """'...d,<w>->...<out>' as `_rows_product`'s 'md,<w>->m<out>' (an ellipsis in <w> stands for
  w's extra leading axes, none on the rows path)."""
  inputs, out = spec.replace(' ', '').split('->')
  x_spec, w_spec = inputs.split(',')
  if not x_spec.startswith('...') or not out.startswith('...'):
    raise ValueError(f'products.einsum takes specs of the form "...d,<w>->...<out>", got {spec!r}')
  free = [c for c in string.ascii_lowercase if c not in spec]
  if '...' in w_spec:
    extra = w_ndim - len(w_spec.replace('...', ''))
    w_spec = w_spec.replace('...', ''.join(free[1:1 + extra]))
  return f'{free[0]}{x_spec[3:]},{w_spec}->{free[0]}{out[3:]}'


def einsum(spec: str, x: Array, w: Array, *, preferred_element_type=None) -> Array:
  """`jnp.einsum(spec, x, w)` for a spec of the form '...d,<w>->...<out>': x's last axis is
  contracted and its leading axes, all free, lead the result (a linear layer, logits)."""
  if not on_fast_path(x.dtype):
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
  rows_spec = _rows_spec(spec, w.ndim)
  return _by_rows(lambda rows: _rows_product(rows_spec, None, rows, w),
                  x, preferred_element_type or jnp.result_type(x, w))


def dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                preferred_element_type=None, **kwargs) -> Array:
  """`jax.lax.dot_general` on the fast path where it contracts lhs's last axis with rhs's
  first, as `nnx.Linear` does (its `dot_general`); other products as they are."""
  (lhs_contract, rhs_contract), (lhs_batch, _) = dimension_numbers
  if (lhs_batch or tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,)
      or not on_fast_path(lhs.dtype) or any(v is not None for v in kwargs.values())):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
  letters = string.ascii_lowercase[2:1 + rhs.ndim]
  return _by_rows(lambda rows: _rows_product(f'ab,b{letters}->a{letters}', precision, rows, rhs),
                  lhs, preferred_element_type or jnp.result_type(lhs, rhs))


def ordered_sum(x: Array, axis: int = -1, keepdims: bool = False) -> Array:
  """The sum along `axis` by a fixed tree of elementwise additions (halves added pairwise).

  An XLA:CPU reduction is vectorised by the whole array's shape, so a row's sum can take other
  bits in a block of other rows. Elementwise additions cannot: this sum of a row has the same
  bits in any block (what `ordered_sum`'s callers need beside the row-invariant products).
  """
  axis = axis % x.ndim
  n = x.shape[axis]
  while n > 1:
    half = n // 2
    total = (jax.lax.slice_in_dim(x, 0, half, axis=axis)
             + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
    if n % 2:
      total = jnp.concatenate([total, jax.lax.slice_in_dim(x, 2 * half, n, axis=axis)], axis)
    x, n = total, total.shape[axis]
  return x if keepdims else jnp.squeeze(x, axis)


def ordered_logsumexp(x: Array) -> Array:
  """log(sum(exp(x))) over the last axis, kept ([..., 1]), summed by `ordered_sum`: a row's
  value has the same bits in any block (x's row maximum must be finite)."""
  top = jnp.max(x, axis=-1, keepdims=True)
  return top + jnp.log(ordered_sum(jnp.exp(x - top), keepdims=True))
