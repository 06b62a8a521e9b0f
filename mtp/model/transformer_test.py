"""Trunk: cached forward equals the full forward; causal and document masking."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.model import kv_cache
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model import transformer


def _positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


def _full_logits(model, tokens):
  hidden, _ = model.trunk(tokens, _positions(*tokens.shape))
  return model.logits(model.trunk.final_norm(hidden))


@pytest.mark.parametrize('tie', [True, False])
def test_cached_forward_matches_full_forward_in_chunks(tie):
  model = testing.tiny_model(tie_embeddings=tie)
  tokens = jnp.asarray(testing.random_tokens((2, 12), 61))
  expected = _full_logits(model, tokens)
  cache = model.init_cache(2, 32)
  lengths = jnp.zeros(2, jnp.int32)
  got = []
  for start, stop in [(0, 5), (5, 6), (6, 9), (9, 12)]:
    out, cache = model.step(tokens[:, start:stop], _positions(2, stop - start, start), cache,
                            lengths)
    got.append(model.logits(out.normed))
    lengths = lengths + (stop - start)
  np.testing.assert_allclose(jnp.concatenate(got, 1), expected, atol=1e-4, rtol=1e-4)


def test_cached_forward_with_a_different_length_per_row():
  model = testing.tiny_model()
  tokens = jnp.asarray(testing.random_tokens((2, 10), 61, seed=1))
  expected = _full_logits(model, tokens)
  # Row 0 has 6 tokens committed, row 1 has 3; both then take 3 more in one call.
  prefix = jnp.array([6, 3])
  cache = model.init_cache(2, 16)
  _, cache = model.step(tokens[:, :6], _positions(2, 6), cache, jnp.zeros(2, jnp.int32))
  new_tokens = jnp.stack([tokens[0, 6:9], tokens[1, 3:6]])
  new_positions = prefix[:, None] + jnp.arange(3)
  out, _ = model.step(new_tokens, new_positions, cache, prefix)
  got = model.logits(out.normed)
  np.testing.assert_allclose(got[0], expected[0, 6:9], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(got[1], expected[1, 3:6], atol=1e-4, rtol=1e-4)


def test_changing_a_later_token_changes_no_earlier_logit():
  model = testing.tiny_model()
  tokens = testing.random_tokens((1, 10), 61, seed=2)
  changed = tokens.copy()
  changed[0, 6] = (changed[0, 6] + 1) % 61
  a = _full_logits(model, jnp.asarray(tokens))
  b = _full_logits(model, jnp.asarray(changed))
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert not np.allclose(a[:, 6:], b[:, 6:])


def test_packed_documents_do_not_see_each_other():
  model = testing.tiny_model()
  first = testing.random_tokens((1, 5), 61, seed=3)
  second = testing.random_tokens((1, 4), 61, seed=4)
  packed = jnp.asarray(np.concatenate([first, second], 1))
  segments = jnp.array([[1] * 5 + [2] * 4])
  positions = jnp.array([list(range(5)) + list(range(4))])
  hidden, _ = model.trunk(packed, positions, segments)
  alone, _ = model.trunk(jnp.asarray(second), _positions(1, 4))
  np.testing.assert_allclose(hidden[:, 5:], alone, atol=1e-5, rtol=1e-5)


def test_tree_block_mask_matches_each_path_run_as_a_chain():
  model = testing.tiny_model()
  prompt = jnp.asarray(testing.random_tokens((1, 4), 61, seed=5))
  cache = model.init_cache(1, 32)
  _, cache = model.step(prompt, _positions(1, 4), cache, jnp.zeros(1, jnp.int32))
  lengths = jnp.array([4])
  # Tree: root r, children a and b, a's child c. Node order [r, a, b, c]; depths [0, 1, 1, 2].
  nodes = jnp.array([[7, 11, 13, 17]])
  parent = [-1, 0, 0, 1]
  mask = np.eye(4, dtype=bool)
  for i in range(4):
    j = parent[i]
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  depth = jnp.array([0, 1, 1, 2])
  out, tree_cache = model.step(nodes, lengths[:, None] + depth, cache, lengths, jnp.asarray(mask))
  tree_logits = model.logits(out.normed)
  for path in ([0, 1, 3], [0, 2]):
    chain_out, _ = model.step(nodes[:, path], lengths[:, None] + jnp.arange(len(path)), cache,
                              lengths)
    np.testing.assert_allclose(model.logits(chain_out.normed), tree_logits[:, path],
                               atol=1e-4, rtol=1e-4)
  # Compacting the path [r, b] then continuing equals having run that path as a chain.
  compacted = kv_cache.compact(tree_cache, lengths, jnp.array([[0, 2, 2]]))
  chain_out, chain_cache = model.step(nodes[:, [0, 2]], lengths[:, None] + jnp.arange(2), cache,
                                      lengths)
  nxt = jnp.array([[5]])
  a, _ = model.step(nxt, jnp.array([[6]]), compacted, jnp.array([6]))
  b, _ = model.step(nxt, jnp.array([[6]]), chain_cache, jnp.array([6]))
  np.testing.assert_allclose(a.normed, b.normed, atol=1e-5, rtol=1e-5)


def test_rotary_embedding_preserves_norm_and_depends_on_relative_position():
  x = jax.random.normal(jax.random.key(0), (1, 2, 1, 8))
  q = transformer.rotary_embedding(x[:, :1], jnp.array([[3]]), 10_000.0)
  k = transformer.rotary_embedding(x[:, 1:], jnp.array([[1]]), 10_000.0)
  q2 = transformer.rotary_embedding(x[:, :1], jnp.array([[7]]), 10_000.0)
  k2 = transformer.rotary_embedding(x[:, 1:], jnp.array([[5]]), 10_000.0)
  np.testing.assert_allclose(jnp.sum(q * k), jnp.sum(q2 * k2), rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(q), jnp.linalg.norm(x[:, :1]), rtol=1e-5)


@pytest.mark.parametrize('field,value,message', [
    ('num_kv_heads', 3, 'multiple of'),
    ('num_layers', 0, 'num_layers must be positive'),
    ('head_dim', 7, 'even'),
])
def test_bad_trunk_config_is_named(field, value, message):
  import dataclasses
  cfg = dataclasses.replace(testing.tiny_config().trunk, **{field: value})
  with pytest.raises(ValueError, match=message):
    cfg.validate()


@pytest.mark.parametrize('head_type,scan', [('medusa', False), ('sequential', False),
                                            ('parallel', True)])
def test_fused_projections_compute_the_same_model(head_type, scan):
  """One matmul for q, k and v and one for gate and up: the same outputs up to rounding, in
  the trunk and in heads built of transformer layers, unrolled or scanned; the original model
  keeps its own projections."""
  import flax.nnx as nnx
  from mtp.model import layout
  model = testing.tiny_model(0, head_type=head_type)
  if scan:
    model = layout.with_layout(model, scan_layers=True)
  fused = transformer.fused_projections(model)
  modules = [m for _, m in nnx.iter_modules(fused)]
  attentions = [m for m in modules if isinstance(m, transformer.Attention)]
  mlps = [m for m in modules if isinstance(m, transformer.MLP)]
  assert attentions and mlps
  assert all(not hasattr(m, 'q_proj') and isinstance(m.qkv_proj, transformer.FusedLinear)
             for m in attentions)
  assert all(not hasattr(m, 'gate') and isinstance(m.gate_up, transformer.FusedLinear)
             for m in mlps)
  assert all(hasattr(m, 'q_proj') for _, m in nnx.iter_modules(model)
             if isinstance(m, transformer.Attention))
  tokens = testing.random_tokens((2, 9), 61, seed=2)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  np.testing.assert_allclose(fused(tokens, positions), model(tokens, positions), atol=2e-5,
                             rtol=2e-5)
  assert transformer.fused_projections(fused) is not fused  # Fusing again changes nothing.
  np.testing.assert_allclose(transformer.fused_projections(fused)(tokens, positions),
                             fused(tokens, positions))


def test_cached_steps_do_not_depend_on_the_cache_capacity():
  """Attention visits the cache a chunk at a time, as far as the rows have filled it: a row's
  prefill and its next step give the same bits whatever the capacity (a server's batch sized for
  its longest request and an offline call sized for its own decode alike)."""
  model = testing.tiny_model(0, mtp_num_heads=0)
  prompt = jnp.asarray(testing.random_tokens((1, 40), 61, seed=3))
  length = jnp.asarray([40], jnp.int32)

  @jax.jit
  def run(cache):
    out, cache = model.step(prompt, jnp.arange(40)[None], cache, jnp.zeros((1,), jnp.int32),
                            with_heads=False)
    nxt, _ = model.step(jnp.asarray([[5, 6]]), length[:, None] + jnp.arange(2)[None], cache,
                        length, with_heads=False)
    return out.normed, nxt.normed

  base = run(model.init_cache(1, 64))
  for capacity in (200, 700, 2048):
    cache = model.init_cache(1, capacity)
    assert cache.capacity % kv_cache.CHUNK == 0 and cache.capacity >= capacity
    for got, want in zip(run(cache), base):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_chunked_attention_equals_attention_over_the_whole_cache():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(2, 256, 2, 8)), jnp.float32)  # [B, S, G, d]
  values = jnp.asarray(rng.normal(size=(2, 256, 2, 8)), jnp.float32)
  lengths = jnp.asarray([130, 7], jnp.int32)
  block = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # A tree: 2's parent is 0.
  got = kv_cache.attend(q, jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), lengths, block)
  slots = jnp.arange(256)[None, None, :]
  relative = slots - lengths[:, None, None]
  visible = (relative < 0) | ((relative >= 0) & (relative < 3) & jnp.take_along_axis(
      jnp.broadcast_to(block, (2, 3, 3)), jnp.clip(relative, 0, 2).repeat(3, axis=1), axis=2))
  want = jax.nn.dot_product_attention(q, keys, values, mask=visible[:, None])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_a_half_precision_cache_on_cpu_is_stored_as_bits_and_read_back_exactly(dtype):
  cache = kv_cache.init_cache(2, 1, 200, 2, 8, dtype)
  assert all(b.dtype == jnp.uint16 for b in cache.keys + cache.values)
  block = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 8)), dtype)  # [B, T, G, d]
  written = kv_cache.write_slots(cache.keys[0], block, jnp.asarray([5]))  # [B, G, S, d]
  np.testing.assert_array_equal(np.asarray(kv_cache.loaded(written[:, :, 5:8], dtype)),
                                np.asarray(jnp.swapaxes(block, 1, 2)))
  with pytest.raises(TypeError, match='half-precision'):
    kv_cache.write_slots(cache.keys[0], block.astype(jnp.float32), jnp.asarray([5]))
  with pytest.raises(TypeError, match='half-precision'):
    kv_cache.loaded(written, jnp.float32)
  assert kv_cache.init_cache(1, 1, 8, 2, 8, jnp.float32).keys[0].dtype == jnp.float32


def test_attention_over_a_whole_mask_reads_a_cache_stored_as_bits():
  """The [B, 1, T, S] mask path reads the buffers whole: as values, stored as bits or not."""
  cfg = dataclasses.replace(testing.tiny_config(mtp_num_heads=0).trunk, dtype='bfloat16',
                            param_dtype='bfloat16')
  attention = transformer.Attention(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, cfg.embed_dim)), jnp.bfloat16)
  positions, lengths = jnp.asarray([[4, 5, 6]]), jnp.asarray([4])
  mask = (jnp.arange(kv_cache.CHUNK)[None, :] <= positions[0][:, None])[None, None]
  shape = (1, cfg.num_kv_heads, kv_cache.CHUNK, cfg.head_dim)
  plain = (jnp.zeros(shape, jnp.bfloat16),) * 2
  bits = kv_cache.init_cache(1, 1, kv_cache.CHUNK, cfg.num_kv_heads, cfg.head_dim,
                             jnp.bfloat16)
  assert bits.keys[0].dtype == jnp.uint16
  want, _ = attention(x, positions, mask, plain, lengths)
  got, _ = attention(x, positions, mask, (bits.keys[0], bits.values[0]), lengths)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_half_precision_cache_is_never_converted_whole():
  """XLA:CPU slices and updates half-precision arrays in float32 and hoists that conversion out
  of the chunk loop: every call converted the layer's whole buffer, a cost in the capacity. The
  bits are stored instead; no float32 array of a buffer's shape is left in the compiled step."""
  cfg = testing.tiny_config(mtp_num_heads=0)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype='bfloat16',
                                                           param_dtype='bfloat16'))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  cache = model.init_cache(2, 1024)
  lengths = jnp.asarray([40, 300], jnp.int32)
  step = jax.jit(lambda cache: model.step(jnp.asarray([[5, 6], [7, 8]]),
                                          lengths[:, None] + jnp.arange(2)[None], cache,
                                          lengths, with_heads=False))
  text = step.lower(cache).compile(compiler_options=testing.DECODING_COMPILE).as_text()
  whole = ','.join(map(str, cache.keys[0].shape))
  assert f'u16[{whole}]' in text and f'f32[{whole}]' not in text and f'bf16[{whole}]' not in text


@pytest.mark.parametrize('dtype, num_tokens', [('float32', 1), ('float32', 4),
                                               ('bfloat16', 1)])
def test_attention_transposes_no_chunk_of_the_cache(dtype, num_tokens):
  """The cache is laid out [B, G, S, d] so that a chunk of it is its products' operand as it
  lies. Laid out [B, S, G, d], every chunk of keys and values was transposed in the loop: 18
  of a 53 ms one-token step of SmolLM2 at batch 4 in bfloat16. (In the one or two chunks that
  hold a half-precision tree block, its nodes off the tree's longest path are gathered per
  query and transposed: `kv_cache_test`, not checked here.)"""
  cfg = testing.tiny_config(mtp_num_heads=0)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype=dtype,
                                                           param_dtype=dtype))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  cache = model.init_cache(2, 4 * kv_cache.CHUNK)
  lengths = jnp.asarray([40, 300], jnp.int32)
  tokens = jnp.arange(2 * num_tokens, dtype=jnp.int32).reshape(2, num_tokens)
  step = jax.jit(lambda cache: model.step(
      tokens, lengths[:, None] + jnp.arange(num_tokens)[None], cache, lengths,
      with_heads=False))
  text = step.lower(cache).compile(compiler_options=testing.DECODING_COMPILE).as_text()
  chunk = re.compile(rf'= \w+\[[\d,]*\b{kv_cache.CHUNK}\b[\d,]*\]\S* transpose\(')
  assert not chunk.findall(text)


def test_a_half_precision_embedding_is_never_converted_whole():
  """XLA:CPU gathers half-precision rows through float32, and in a decoding loop it hoisted the
  conversion of the whole table out of the loop: every call converted it (SmolLM2: 28M values,
  about 35 ms); a view of its bits was hoisted and copied alike. The bits are gathered in the
  step instead, with the same rows and gradient."""
  cfg = testing.tiny_config(mtp_num_heads=0)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype='bfloat16',
                                                           param_dtype='bfloat16'))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  table = model.trunk.embedding.embedding[...]
  assert table.dtype == jnp.bfloat16

  graphdef, weights = nnx.split(model)

  @jax.jit
  def steps(weights, cache):  # The weights as arguments, as decoding passes them.
    m = nnx.merge(graphdef, weights)
    def step(i, carry):
      token, cache = carry
      lengths = jnp.full((1,), i, jnp.int32)
      out, cache = m.step(token, lengths[:, None], cache, lengths, with_heads=False)
      return jnp.argmax(m.logits(out.normed), -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, 4, step, (jnp.zeros((1, 1), jnp.int32), cache))[0]
  # No kernel makes a whole table (a conversion, or a copy of its bits hoisted out); inside a
  # fused kernel its bits are only viewed.
  whole = re.compile(rf'= \w+\[{table.shape[0]},{table.shape[1]}\]\S* '
                     r'(fusion|convert|copy|bitcast-convert)\(')

  def made_whole(lowered) -> list[str]:
    compiled = lowered.compile(compiler_options=testing.DECODING_COMPILE)
    kernels = re.split(r'\n(?=%|ENTRY)', compiled.as_text())
    return [m.group(0) for kernel in kernels if not kernel.startswith(('%fused', '%wrapped'))
            for m in whole.finditer(kernel)]
  assert not made_whole(steps.lower(weights, model.init_cache(1, 8)))

  @jax.jit
  def lookups(table):  # The pattern alone: a loop that reads the table whole and by rows.
    def step(_, x):
      rows = jnp.concatenate([x, jnp.zeros((3, x.shape[1]), x.dtype)])
      logits = jnp.einsum('md,vd->mv', rows, table, preferred_element_type=jnp.float32)[:1]
      return transformer.take_rows(table, jnp.argmax(logits, -1).astype(jnp.int32))
    return jax.lax.fori_loop(0, 4, step, jnp.zeros((1, table.shape[1]), table.dtype))
  assert not made_whole(lookups.lower(table))

  ids = jnp.asarray([[3, 0, 3], [cfg.trunk.vocab_size - 1, 7, 2]])
  np.testing.assert_array_equal(np.asarray(transformer.take_rows(table, ids), np.float32),
                                np.asarray(jnp.take(table, ids, axis=0), np.float32))
  loss = lambda take: lambda t: jnp.sum(take(t, ids).astype(jnp.float32) ** 2)
  np.testing.assert_array_equal(
      np.asarray(jax.grad(loss(transformer.take_rows))(table), np.float32),
      np.asarray(jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0)))(table), np.float32))


@pytest.mark.parametrize('scan', [False, True])
def test_train_forward_returns_layer_inputs_and_the_same_hidden_state(scan):
  cfg = testing.tiny_config(num_layers=3)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, scan_layers=scan))
  trunk = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0)).trunk
  tokens = jnp.asarray(testing.random_tokens((2, 7), 61))
  positions = _positions(2, 7)
  hidden, _ = trunk(tokens, positions)
  split, inputs = trunk.train_forward(tokens, positions, None, (2, 0))
  np.testing.assert_array_equal(split, hidden)  # Run in segments, bit for bit the same.
  assert sorted(inputs) == [0, 2]
  np.testing.assert_array_equal(inputs[0], trunk.embed(tokens))
  mask = transformer.training_mask(jnp.ones((2, 7), jnp.int32))
  x = inputs[2]
  x, _ = trunk.layer(2)(x, positions, mask)
  np.testing.assert_allclose(x, hidden, atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match=r'Trunk layer inputs \[3\] asked for; the trunk has '
                                       r'layers 0..2'):
    trunk.train_forward(tokens, positions, None, (3,))


@pytest.mark.parametrize('dtype, tolerance', [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_attention_with_own_keys_is_dense_attention_over_them_as_more_slots(dtype, tolerance):
  """`attend_with_own` (EAGLE's training-time test) equals attention over the block's keys and
  every query's own E keys laid out as E*T more slots, each seen by its own query only."""
  b, t, h, g, d, e = 2, 6, 4, 2, 8, 3
  q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, d)).astype(dtype)
             for i, n in enumerate((h, g, g)))
  own_k, own_v = (jax.random.normal(jax.random.key(5 + i), (b, t, e, g, d)).astype(dtype)
                  for i in range(2))
  segments = jnp.asarray([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]])
  mask = transformer.training_mask(segments)
  out = transformer.attend_with_own(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask, own_k,
                                    own_v)
  slots = lambda x, own: jnp.concatenate([x] + [own[:, :, i] for i in range(e)], axis=1)
  diagonal = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, 1, t, t))
  dense = jax.nn.dot_product_attention(
      q, jnp.repeat(slots(k, own_k), h // g, axis=2), jnp.repeat(slots(v, own_v), h // g, axis=2),
      mask=jnp.concatenate([mask] + [diagonal] * e, axis=-1))
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dense, np.float32),
                             atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize('scan', [False, True])
def test_a_cached_step_traces_its_layers_once_and_computes_what_each_layer_does(scan,
                                                                                monkeypatch):
  """Tracing a cached step of 4 layers traces attention once (SmolLM2's 30: 0.74 s a step
  became 0.07), and the step equals its layers called one after another, in order."""
  from mtp.model import layout
  cfg = testing.tiny_config(mtp_num_heads=0, num_layers=4)
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(3))
  if scan:
    model = layout.with_layout(model, scan_layers=True)
  transformer._cached_block.clear_cache()  # Another test may have traced this layer.
  traced = []
  attend = kv_cache.attend
  monkeypatch.setattr(kv_cache, 'attend', lambda *a, **k: traced.append(1) or attend(*a, **k))
  tokens = jnp.asarray(testing.random_tokens((2, 5), 61, seed=4))
  cache, lengths = model.init_cache(2, 128), jnp.asarray([0, 0], jnp.int32)
  mask = np.tril(np.ones((5, 5), bool))
  step = jax.jit(lambda tokens, cache: model.trunk.cached_forward(
      tokens, _positions(2, 5), cache, lengths, mask)[0])
  hidden = step(tokens, cache)
  assert len(traced) == 1
  x = model.trunk.embed(tokens)
  for i in range(cfg.trunk.num_layers):
    x, _ = model.trunk.layer(i)(x, _positions(2, 5), mask, (cache.keys[i], cache.values[i]),
                                lengths)
  np.testing.assert_allclose(hidden, x, atol=1e-5, rtol=1e-5)
