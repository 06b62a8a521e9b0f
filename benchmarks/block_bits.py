r"""Whether a block's nodes keep the bits their tokens get decoded one at a time.

  python -m benchmarks.block_bits --workdir=workdirs/smollm2 --drafters=heads,lookup
  python -m benchmarks.block_bits --workdir=workdirs/smollm2_demo --decoder=auto

Greedy speculative decoding in half precision on CPU equals autoregressive decoding only if
every node of a verified block has the logits, bit for bit, that its token gets from a one-token
step (`model/products.py`, `kv_cache.attend`). For each held-out code prompt and each offset
into its greedy continuation: the continuation is decoded one token at a time from that offset
(cached steps), then each root-to-leaf path of the decoder's block is verified with the
continuation's tokens on the path and random tokens elsewhere, and the path's nodes are compared
with the steps. Prints the paths whose nodes part, and at which depths; exits 1 if any do.

Found this way (2026-12-07, 2 AVX512-BF16 cores without AMX, jax 0.10.2): SmolLM2's block of
a heads' chain of 4 beside a lookup chain of 8 parted at depths 1-4 of the heads' chain (6 of
13 paths over 2 prompts and 4 offsets), and greedy `auto` in `make demo` decoded 1 of 8
held-out code prompts otherwise than autoregressive decoding. The cause: the heads' nodes,
gathered into logical order, took their scores over the block's 13 keys in a product XLA:CPU
ran in float32 code of its own, not in the chunks' bfloat16 kernel (`kv_cache._block_scores`
now pads the keys to a chunk). After that change, none of those paths parts.
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', 'workdirs/smollm2_demo', 'Workdir to load.')
flags.DEFINE_string('dtype', 'bfloat16', 'Compute dtype the model is loaded in.')
flags.DEFINE_string('decoder', 'speculative', 'Decoder whose block is verified.')
flags.DEFINE_list('drafters', None, 'Drafters of the block (None: the decoder\'s).')
flags.DEFINE_integer('num_prompts', 2, 'Held-out code prompts.')
flags.DEFINE_integer('prompt_tokens', 256, 'Prompts hold as many whole lines as fit.')
flags.DEFINE_list('offsets', ['0', '24', '48'], 'Offsets into the greedy continuation.')


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  import mtp
  from benchmarks import heldout_prompts
  from mtp.decode import plan as plan_lib
  from mtp.decode import trees
  from mtp.decode import verification

  loaded = mtp.load(FLAGS.workdir, dtype=FLAGS.dtype)
  model, tokenizer = loaded.model, loaded.tokenizer
  options = {} if FLAGS.drafters is None else dict(drafters=tuple(FLAGS.drafters))
  if FLAGS.decoder == 'auto':
    options['break_even'] = 0.0  # Nothing to measure: only the block's shape matters.
  engine = plan_lib.resolve(loaded, FLAGS.decoder, max_new_tokens=128, **options)
  tree = trees.join([d.tree for d in engine.plan.drafters])[0]
  offsets = [int(o) for o in FLAGS.offsets]
  steps = max(offsets) + tree.max_depth
  capacity = 4096

  @jax.jit
  def prefill(tokens):
    cache = model.init_cache(1, capacity)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    return model.step(tokens[None], positions, cache, jnp.zeros((1,), jnp.int32),
                      with_heads=False)[1]

  @jax.jit
  def one_token(token, position, cache):
    out, cache = model.step(token[None, None], position[None, None], cache, position[None],
                            with_heads=False)
    return model.logits(out.normed)[0, 0].astype(jnp.float32), cache

  @jax.jit
  def verify(nodes, start, cache):
    positions = (start + jnp.asarray(tree.depth, jnp.int32))[None]
    out, _, _ = verification.step(model, tree, nodes[None], positions, cache, start[None],
                                  with_heads=model.heads is not None)
    return model.logits(out.normed)[0].astype(jnp.float32)

  print(f'{FLAGS.workdir} ({FLAGS.dtype}), {FLAGS.decoder} block of {tree.num_nodes} nodes, '
        f'depth {tree.max_depth}, {len(tree.node_paths)} paths')
  rng = np.random.default_rng(0)
  parted = 0
  texts = heldout_prompts.of_kind('code', tokenizer, FLAGS.num_prompts, FLAGS.prompt_tokens)
  for i, text in enumerate(texts):
    ids = tokenizer.encode(text)
    cache = prefill(jnp.asarray(ids[:-1], jnp.int32))
    tokens = list(ids)
    for position in range(len(ids) - 1, len(ids) - 1 + steps):  # Greedy, a token a step.
      row, cache = one_token(jnp.int32(tokens[-1]), jnp.int32(position), cache)
      tokens.append(int(np.argmax(np.asarray(row))))
    for offset in offsets:
      start = len(ids) - 1 + offset
      base = prefill(jnp.asarray(tokens[:start], jnp.int32))
      cache, alone = base, []  # The path's tokens decoded one at a time from the same cache.
      for depth in range(tree.max_depth + 1):
        row, cache = one_token(jnp.int32(tokens[start + depth]), jnp.int32(start + depth),
                               cache)
        alone.append(np.asarray(row))
      for path in tree.node_paths:
        path = [int(n) for n in path if n >= 0]
        nodes = rng.integers(0, model.cfg.trunk.vocab_size, tree.num_nodes).astype(np.int32)
        for depth, node in enumerate(path):
          nodes[node] = tokens[start + depth]
        got = np.asarray(verify(jnp.asarray(nodes), jnp.int32(start), base))
        depths = [d for d, n in enumerate(path) if not np.array_equal(got[n], alone[d])]
        if depths:
          parted += 1
          print(f'  prompt {i}, offset {offset}: path {path} parts at depths {depths}')
  print(f'paths whose nodes part from one-token steps: {parted}')
  sys.exit(1 if parted else 0)


if __name__ == '__main__':
  app.run(main)
