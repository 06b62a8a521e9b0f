r"""Weight storage for decoding on this CPU: float32, bfloat16 and int8, side by side.

  python -m benchmarks.weight_storage [--block_sizes=1,8] [--rounds=7]

A decoding step reads every weight once for a few tokens, so storing weights in fewer bytes
could make it faster where it is bound by memory. This times the matmuls of SmolLM2-135M's 30
layers (fused q/k/v and gate/up, as decoding runs them; random weights, batch 1, T tokens) in
one jitted loop per variant, variants in turns, the fastest round counting:
  * float32 weights and products (what decoding runs);
  * bfloat16 weights converted to float32 for each product (float32 accumulation);
  * bfloat16 weights and activations into a bfloat16 product accumulated in float32;
  * int8 weights with one float32 scale per output column, converted for each product.
Attention over the cache, norms and the output layer are left out: they do not change with the
weights' storage.

Writes results/weight_storage.json.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

import benchmarks

FLAGS = flags.FLAGS
flags.DEFINE_list('block_sizes', ['1', '8'], 'Tokens per step (T).')
flags.DEFINE_integer('rounds', 7, 'Timed rounds; the fastest counts.')
flags.DEFINE_integer('iterations', 20, 'Steps per timed loop.')
flags.DEFINE_string('output', 'results/weight_storage.json', 'JSON results.')


def _variants():
  """name -> (weights per layer, matmul(x, weight))."""
  import jax.numpy as jnp
  import numpy as np
  shape = benchmarks.SMOLLM2_SHAPE
  d, kv = shape['embed_dim'], shape['num_kv_heads'] * shape['head_dim']
  q, m = shape['num_attention_heads'] * shape['head_dim'], shape['mlp_dim']
  rng = np.random.default_rng(0)
  layers = [{name: rng.normal(0, 0.02, size).astype(np.float32) for name, size in
             (('qkv', (d, q + 2 * kv)), ('o', (q, d)), ('gate_up', (d, 2 * m)), ('down', (m, d)))}
            for _ in range(shape['num_layers'])]

  def cast(dtype):
    return [{k: jnp.asarray(v, dtype) for k, v in layer.items()} for layer in layers]

  def int8(w):
    scale = np.abs(w).max(0, keepdims=True) / 127
    return dict(q=jnp.asarray(np.round(w / scale).astype(np.int8)), scale=jnp.asarray(scale))

  return {
      'float32': (cast(jnp.float32), lambda x, w: x @ w),
      'bfloat16 weights, float32 product': (
          cast(jnp.bfloat16), lambda x, w: x @ w.astype(jnp.float32)),
      'bfloat16 product, float32 accumulation': (
          cast(jnp.bfloat16), lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w,
                                                   preferred_element_type=jnp.float32)),
      'int8 weights, float32 product': (
          [{k: int8(v) for k, v in layer.items()} for layer in layers],
          lambda x, w: (x @ w['q'].astype(jnp.float32)) * w['scale']),
  }, q, m


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import jax
  import jax.numpy as jnp
  variants, q_width, mlp = _variants()

  def layer(x, w, matmul):
    qkv = matmul(x, w['qkv'])
    h = x + matmul(qkv[..., :q_width], w['o'])
    gate_up = matmul(h, w['gate_up'])
    return h + matmul(jax.nn.silu(gate_up[..., :mlp]) * gate_up[..., mlp:], w['down'])

  def loop(x, weights, matmul):
    def body(_, x):
      for w in weights:
        x = layer(x, w, matmul)
      return x * 0.5  # Keeps values bounded over the iterations.
    return jax.lax.fori_loop(0, FLAGS.iterations, body, x)

  rows = []
  for t in (int(b) for b in FLAGS.block_sizes):
    x = jnp.ones((1, t, benchmarks.SMOLLM2_SHAPE['embed_dim']), jnp.float32)
    compiled = {name: jax.jit(lambda x, w, matmul=matmul: loop(x, w, matmul))
                for name, (_, matmul) in variants.items()}
    for name, (weights, _) in variants.items():
      compiled[name](x, weights).block_until_ready()
    best = {name: float('inf') for name in variants}
    for _ in range(FLAGS.rounds):
      for name, (weights, _) in variants.items():
        start = time.perf_counter()
        compiled[name](x, weights).block_until_ready()
        best[name] = min(best[name], (time.perf_counter() - start) / FLAGS.iterations)
    for name, seconds in best.items():
      rows.append(dict(tokens=t, storage=name, ms_per_step=seconds * 1e3,
                       vs_float32=seconds / best['float32']))
      print(f'T={t:<3} {name:<40} {seconds * 1e3:7.2f} ms  {seconds / best["float32"]:.2f}x',
            flush=True)
  benchmarks.write_json(FLAGS.output, dict(rows=rows, device=jax.devices()[0].device_kind,
                                           rounds=FLAGS.rounds))


if __name__ == '__main__':
  app.run(main)
