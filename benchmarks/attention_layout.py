r"""Cached attention in two KV-cache layouts, side by side: which one XLA runs faster here.

  python -m benchmarks.attention_layout [--batch_sizes=1,8] [--token_counts=1,5,13]

[B, S, G, H] (slots before KV heads) is what `jax.nn.dot_product_attention` reads directly;
[B, G, S, H] lets a grouped einsum contract each head's contiguous slots without a transpose.
Which is faster depends on the shape: on a 2-core CPU, at SmolLM2's attention shape (9 query /
3 KV heads of 64, 656 slots), [B, G, S, H] won at batch 8 for 13 new tokens (2.5 vs 3.6 ms) and
lost for one (1.36 vs 0.98 ms). That was when decoding attended through dot_product_attention,
and the cache stayed [B, S, G, H]. Decoding now attends chunk by chunk (`kv_cache.attend`),
where that layout transposed every chunk it read, and the cache is [B, G, S, H] (2026-12-05:
SmolLM2's whole verification step 3-14% faster in bfloat16 and float32; see the README).

Prints microseconds per attention call for dot_product_attention on [B, S, G, H] and a grouped
einsum on each layout; outputs are checked equal.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('batch_sizes', ['1', '8'], 'Rows.')
flags.DEFINE_list('token_counts', ['1', '5', '13'], 'New tokens per row (T).')
flags.DEFINE_integer('slots', 656, 'Cache slots (S).')
flags.DEFINE_integer('query_heads', 9, 'Query heads (SmolLM2: 9).')
flags.DEFINE_integer('kv_heads', 3, 'KV heads (SmolLM2: 3).')
flags.DEFINE_integer('head_dim', 64, 'Head dimension (SmolLM2: 64).')
flags.DEFINE_integer('calls', 200, 'Calls per timed run (the best of 5 runs counts).')


def _grouped(q, keys, values, mask, layout: str):
  import jax
  import jax.numpy as jnp
  b, t, num_q, h = q.shape
  g = keys.shape[1] if layout == 'bgsh' else keys.shape[2]
  grouped = q.reshape(b, t, g, num_q // g, h) * h ** -0.5
  kv = 'bgsh' if layout == 'bgsh' else 'bsgh'
  scores = jnp.einsum(f'btgrh,{kv}->bgrts', grouped, keys)
  weights = jax.nn.softmax(jnp.where(mask[:, :, None], scores, -1e30), axis=-1)
  return jnp.einsum(f'bgrts,{kv}->btgrh', weights, values).reshape(b, t, num_q, h)


def _seconds(fn, *args) -> float:
  import jax
  jax.block_until_ready(fn(*args))
  best = float('inf')
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(FLAGS.calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / FLAGS.calls)
  return best


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  s, q_heads, g, h = FLAGS.slots, FLAGS.query_heads, FLAGS.kv_heads, FLAGS.head_dim
  print(f'{"batch":>5} {"T":>3}  {"dpa [B,S,G,H]":>14} {"einsum [B,G,S,H]":>17} '
        f'{"einsum [B,S,G,H]":>17}  (microseconds per call)')
  for b in map(int, FLAGS.batch_sizes):
    for t in map(int, FLAGS.token_counts):
      keys = jax.random.split(jax.random.key(0), 3)
      q = jax.random.normal(keys[0], (b, t, q_heads, h))
      k = jax.random.normal(keys[1], (b, s, g, h))
      v = jax.random.normal(keys[2], (b, s, g, h))
      k_g, v_g = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
      mask = jnp.ones((b, 1, t, s), bool)
      dpa = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m))
      by_head = jax.jit(functools.partial(_grouped, layout='bgsh'))
      by_slot = jax.jit(functools.partial(_grouped, layout='bsgh'))
      want = dpa(q, k, v, mask)
      np.testing.assert_allclose(by_head(q, k_g, v_g, mask), want, atol=1e-4)
      np.testing.assert_allclose(by_slot(q, k, v, mask), want, atol=1e-4)
      times = [_seconds(dpa, q, k, v, mask), _seconds(by_head, q, k_g, v_g, mask),
               _seconds(by_slot, q, k, v, mask)]
      print(f'{b:>5} {t:>3}  {times[0] * 1e6:>14.0f} {times[1] * 1e6:>17.0f} '
            f'{times[2] * 1e6:>17.0f}', flush=True)


if __name__ == '__main__':
  app.run(main)
