"""Speculative Streaming: the stream mask and attention, the main stream untouched, streams blind
to the future and to other positions' streams, training lowers the streams' losses, tiny
parameters, options and unsupported combinations named; in decoding, a verified tree's streams
equal training's, sampling is exact, and a trained model's streams draft most tokens exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from mtp.decode import speculative_test as exact_tests
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model import transformer
from mtp.model.heads import streaming
from mtp.parallel import mesh as mesh_lib
from mtp.train import loss as loss_lib
from mtp.train import step as step_lib
from mtp.train import testing as train_testing


def _positions(b, t):
  return jnp.broadcast_to(jnp.arange(t), (b, t))


def _config(num_heads=3, num_layers=3, scan_layers=False, vocab_size=61, **options):
  cfg = testing.tiny_config(mtp_num_heads=num_heads, head_type='streaming',
                            num_layers=num_layers, vocab_size=vocab_size)
  return dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, scan_layers=scan_layers),
                             head_options=tuple(sorted(options.items())))


def _model(seed=0, **kwargs):
  """A streaming model whose adapters (if any) are random, so that they act."""
  model = mtp_model.MTPModel(_config(**kwargs), rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for path, param in nnx.iter_graph(model.heads):
    if isinstance(param, nnx.Param) and path[-1] in ('q_up', 'v_up'):
      param[...] = rng.normal(0, 0.3, param[...].shape).astype(np.float32)
  return model


def _segments(rng, b, t):
  """Random packed rows: documents of random lengths, sometimes padding (id 0) at the end."""
  rows = []
  for _ in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t), rng.integers(0, 3), replace=False))
    ids = np.zeros(t, np.int32)
    for n, part in enumerate(np.split(np.arange(t), cuts)):
      ids[part] = n + 1
    if rng.random() < 0.5:
      ids[t - rng.integers(1, 3):] = 0
    rows.append(ids)
  return jnp.asarray(np.stack(rows))


def _brute_force_mask(segment_ids: np.ndarray, gamma: int) -> np.ndarray:
  b, t = segment_ids.shape
  out = np.zeros((b, 1, t * gamma, t + t * gamma), bool)
  for row in range(b):
    for q in range(t):
      for j in range(gamma):
        for s in range(t):
          out[row, 0, q * gamma + j, s] = s <= q and segment_ids[row, s] == segment_ids[row, q]
          for i in range(gamma):
            out[row, 0, q * gamma + j, t + s * gamma + i] = s == q and i <= j
  return out


@pytest.mark.parametrize('seed', range(4))
def test_stream_mask_equals_brute_force(seed):
  rng = np.random.default_rng(seed)
  gamma = int(rng.integers(1, 4))
  segment_ids = _segments(rng, 3, 7)
  mask = streaming.stream_mask(transformer.training_mask(segment_ids), gamma)
  np.testing.assert_array_equal(mask, _brute_force_mask(np.asarray(segment_ids), gamma))


def test_stream_attention_equals_dense_attention_over_the_mask():
  rng = np.random.default_rng(0)
  b, t, gamma, nq, g, h = 2, 6, 3, 4, 2, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  q, k_main, v_main = normal(b, t, gamma, nq, h), normal(b, t, g, h), normal(b, t, g, h)
  k_streams, v_streams = normal(b, t, gamma, g, h), normal(b, t, gamma, g, h)
  mask = transformer.training_mask(_segments(rng, b, t))
  out = streaming.stream_attention(q, k_main, v_main, k_streams, v_streams, mask)
  keys = jnp.concatenate([k_main, k_streams.reshape(b, t * gamma, g, h)], axis=1)
  values = jnp.concatenate([v_main, v_streams.reshape(b, t * gamma, g, h)], axis=1)
  dense = jax.nn.dot_product_attention(q.reshape(b, t * gamma, nq, h), keys, values,
                                       mask=streaming.stream_mask(mask, gamma))
  np.testing.assert_allclose(out.reshape(b, t * gamma, nq, h), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('rank,scan_layers', [(0, False), (2, False), (2, True)])
def test_main_stream_is_bit_identical_to_the_trunk_alone(rank, scan_layers):
  cfg = _config(scan_layers=scan_layers, streaming_adapter_rank=rank)
  model = _model(scan_layers=scan_layers, streaming_adapter_rank=rank)
  # The same seed builds the same trunk first; the heads come after it.
  base = mtp_model.MTPModel(dataclasses.replace(cfg, mtp_num_heads=0), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(testing.random_tokens((2, 9), 61))
  segment_ids = _segments(rng, 2, 9)
  out = model(tokens, _positions(2, 9), segment_ids)
  assert out.shape == (4, 2, 9, 32)
  np.testing.assert_array_equal(out[0], base(tokens, _positions(2, 9), segment_ids)[0])
  assert not np.allclose(out[1], out[0], atol=1e-3)  # The streams differ from the trunk.
  assert model.num_cache_layers == 3 and model.num_verified_cache_layers == 3


def test_streams_read_no_token_after_their_position():
  model = _model(streaming_adapter_rank=2)
  tokens = testing.random_tokens((2, 10), 61)
  out = model(jnp.asarray(tokens), _positions(2, 10))
  for t in (0, 4, 8):
    changed = tokens.copy()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 61
    perturbed = model(jnp.asarray(changed), _positions(2, 10))
    np.testing.assert_allclose(perturbed[:, :, :t + 1], out[:, :, :t + 1], atol=1e-6, rtol=0)
    assert not np.allclose(perturbed[1:, :, t + 1:], out[1:, :, t + 1:], atol=1e-4)


def test_stream_j_reads_only_its_positions_streams_up_to_j():
  """The gradient of stream j's output at t reaches the stream inputs of (t, 1..j) only."""
  model = _model(streaming_adapter_rank=2)
  b, t, gamma, d = 2, 7, 3, 32
  tokens = jnp.asarray(testing.random_tokens((b, t), 61))
  trunk = model.trunk
  _, layer_inputs = trunk.train_forward(tokens, _positions(b, t), None,
                                        model.cfg.trunk_layer_inputs)
  mask = transformer.training_mask(jnp.ones((b, t), jnp.int32))
  streams = jnp.asarray(np.random.default_rng(0).normal(size=(b, t, gamma, d)), jnp.float32)

  def run(streams):
    return model.heads.run_streams(trunk, streams, layer_inputs, _positions(b, t),
                                   _positions(b, t), mask)

  out, vjp = jax.vjp(run, streams)
  for position, j in [(0, 0), (3, 1), (6, 2), (4, 0)]:
    cotangent = jnp.zeros_like(out).at[:, position, j].set(1.0)
    (grad,) = vjp(cotangent)
    reached = np.asarray(jnp.any(grad != 0, axis=(0, 3)))  # [T, γ]
    expected = np.zeros((t, gamma), bool)
    expected[position, :j + 1] = True
    np.testing.assert_array_equal(reached, expected)


@pytest.fixture(scope='module')
def counting():
  """configs/tiny.py with streams trained jointly on counting rows (token t+1+j is token t
  plus 1+j): (config, losses before, losses after, the trained model)."""
  config = train_testing.tiny_config(**{
      'model.mtp_head_type': 'streaming', 'model.vocab_size': 32,
      'model.streaming_adapter_rank': 2, 'optim.warmup_steps': 5,
      'optim.learning_rate': 1e-2, 'num_train_steps': 40})
  return (config, *train_testing.train_on_counting(config))


@pytest.fixture(scope='module')
def counting_model(counting):
  return counting[3]


def test_joint_training_from_scratch_lowers_the_stream_losses(counting):
  _, before, after, _ = counting
  for k in (1, 2, 3):
    assert after[f'head_{k}_loss'] < 0.5 * before[f'head_{k}_loss'], (k, before, after)
  assert after['head_3_acc'] > 0.5, after


def _num_params(config, head_type, **options):
  model_config = dict(config.model, mtp_head_type=head_type, **options)
  cfg = mtp_model.ModelConfig.from_config(model_config)
  cfg.validate()
  heads = nnx.eval_shape(lambda: cfg.family(cfg.trunk, cfg.mtp_num_heads, cfg.options,
                                            rngs=nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(heads)))


def test_extra_parameters_are_tiny_next_to_medusa():
  config = tiny.get_config()
  m = config.model
  gamma, d = m.mtp_num_heads, m.embed_dim
  medusa = _num_params(config, 'medusa')
  assert medusa == gamma * (d * d + d)
  # The embeddings alone: γ·D, 1/(D + 1) of Medusa's ResBlocks (D = 64 here: 1.5%; the 1%
  # target holds from D = 99 on, e.g. configs/base.py's D = 256 below).
  assert _num_params(config, 'streaming') == gamma * d
  rank, layers = 1, 2
  adapters = _num_params(config, 'streaming', streaming_adapter_rank=rank)
  per_layer = rank * (2 * d + m.num_attention_heads * m.head_dim + m.num_kv_heads * m.head_dim)
  assert adapters == gamma * d + gamma * layers * per_layer
  # SmolLM2-135M's shape (the project's pretrained trunk), and configs/base.py's.
  smollm2 = dict(vocab_size=49152, embed_dim=576, num_layers=30, num_attention_heads=9,
                 num_kv_heads=3, head_dim=64, mlp_dim=1536)
  for shape, options in [(smollm2, {}), (smollm2, dict(streaming_layers=1,
                                                        streaming_adapter_rank=1)), ({}, {})]:
    config.model.update(shape)
    config.model.embed_dim = shape.get('embed_dim', 256)
    ratio = (_num_params(config, 'streaming', **options) / _num_params(config, 'medusa'))
    assert ratio <= 0.01, (shape, options, ratio)


@pytest.mark.parametrize('options,message', [
    (dict(streaming_layers=0), r'model.streaming_layers must be an integer >= 1, got 0'),
    (dict(streaming_layers=4), r'model.streaming_layers must be in \[1, model.num_layers = 3\]'),
    (dict(streaming_layers=1.5), r'model.streaming_layers must be an integer'),
    (dict(streaming_adapter_rank=-1), r'model.streaming_adapter_rank must be an integer >= 0'),
])
def test_bad_options_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    mtp_model.MTPModel(_config(**options), rngs=nnx.Rngs(0))


def test_streams_at_head_positions_only_equal_all_streams_there():
  """Training with a head-loss stride runs the streams of the positions whose losses count
  only: equal there (packed rows, adapters), zero elsewhere, the same gradients."""
  model = _model(streaming_adapter_rank=2)
  b, t = 3, 12
  tokens = jnp.asarray(testing.random_tokens((b, t), 61))
  segments = _segments(np.random.default_rng(3), b, t)
  positions = _positions(b, t)
  at = loss_lib.head_positions(t, 3, 7)  # 1, 4, 7, 10
  full = model(tokens, positions, segments)
  strided = model(tokens, positions, segments, at)
  np.testing.assert_array_equal(strided[0], full[0])  # The main stream.
  np.testing.assert_allclose(strided[1:, :, at], full[1:, :, at], atol=1e-5)
  assert not np.any(strided[1:, :, np.setdiff1d(np.arange(t), at)])

  graphdef, params = nnx.split(model)

  def read_there(params, head_positions):
    out = nnx.merge(graphdef, params)(tokens, positions, segments, head_positions)
    return jnp.sum(jnp.sin(out[1:, :, at]))

  grads = [nnx.state(nnx.merge(graphdef, jax.grad(read_there)(params, p)).heads)
           for p in (None, at)]
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), *grads)


def test_a_strided_training_step_is_the_same_step():
  """The trainer passes the step's head positions: two steps give the losses of streams run at
  every position (the family's flag off)."""
  config = train_testing.tiny_config(**{
      'model.mtp_head_type': 'streaming', 'model.vocab_size': 32, 'mtp_head_loss_stride': 2,
      'optim.learning_rate': 1e-2})
  rows = np.random.default_rng(0).integers(0, 32, (8, 32)).astype(np.int32)
  arrays = {'tokens': rows, 'segment_ids': np.ones_like(rows),
            'positions': np.broadcast_to(np.arange(32, dtype=np.int32), rows.shape)}

  def losses():
    trainer = step_lib.Trainer(config, mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1)))
    state, out = trainer.init_state(), []
    for _ in range(2):
      state, metrics = trainer.train_step(state, trainer.train_batch(arrays))
      out.append([float(metrics[k]) for k in ('loss', 'head_1_loss', 'head_2_loss')])
    return out

  strided = losses()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(streaming.StreamingHeads, 'TRAINS_AT_HEAD_POSITIONS', False)
    every = losses()
  np.testing.assert_allclose(strided, every, rtol=1e-5)


def test_a_trunk_state_without_the_layer_inputs_is_refused():
  model = _model()
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match='reads the inputs of trunk layers'):
    model.outputs_from_trunk(jnp.zeros((1, 4, 32)), tokens, _positions(1, 4),
                             jnp.ones((1, 4), jnp.int32))


@pytest.mark.parametrize('rank,scan_layers,fused', [(0, False, False), (2, True, True)])
def test_streams_of_a_verified_tree_equal_the_training_streams(rank, scan_layers, fused):
  """Prefill, then verify a tree: every node's streams (the next drafts) equal the training
  forward's streams at the end of the text that node's path spells (the cache's chunked
  attention and the family's reading of the main keys from the cache change nothing but
  rounding), with adapters, scanned layers and the decoding copy's fused projections."""
  model = _model(streaming_adapter_rank=rank, scan_layers=scan_layers)
  stepper = transformer.fused_projections(model) if fused else model
  prompt = testing.random_tokens((2, 5), 61, seed=3)
  tree = trees.tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
  nodes = testing.random_tokens((2, tree.num_nodes), 61, seed=4)
  cache = stepper.init_cache(2, 32)
  lengths = jnp.zeros(2, jnp.int32)
  _, cache = stepper.step(jnp.asarray(prompt), _positions(2, 5), cache, lengths)
  lengths = jnp.full(2, 5, jnp.int32)
  out, _ = stepper.step(jnp.asarray(nodes), lengths[:, None] + jnp.asarray(tree.depth)[None],
                        cache, lengths, block_mask=jnp.asarray(tree.attention_mask))
  assert out.features.shape == (2, tree.num_nodes, 3, 32)
  # Each node's text (the prompt, then its path: ancestors in depth order, then itself),
  # right-padded into one batch for one training forward (causal: padding changes nothing).
  paths = [np.nonzero(tree.attention_mask[n])[0] for n in range(tree.num_nodes)]
  width = 5 + tree.max_depth + 1
  texts = np.zeros((tree.num_nodes, 2, width), np.int32)
  for n, path in enumerate(paths):
    texts[n, :, :5 + len(path)] = np.concatenate([prompt, nodes[:, path]], axis=1)
  trained = model(jnp.asarray(texts.reshape(-1, width)), _positions(2 * tree.num_nodes, width))
  trained = trained.reshape(4, tree.num_nodes, 2, width, 32)  # [K + 1, N, B, T, D]
  for n, path in enumerate(paths):
    np.testing.assert_allclose(jnp.transpose(out.features[:, n], (1, 0, 2)),
                               trained[1:, n, :, 4 + len(path)], atol=2e-5, rtol=2e-5)
  # Drafts are stream j's logits at the accepted node: no pass of their own.
  logits, _ = stepper.draft_logits(out.features, jnp.zeros((2, 9), jnp.int32),
                                   jnp.array([3, 0]), cache, lengths, depth=2)
  np.testing.assert_allclose(logits[:, 1], model.logits(out.features[1, 0, :2]), rtol=1e-5,
                             atol=1e-5)


def test_sampled_generations_follow_the_target_distribution():
  """Exact rejection sampling with the streams' drafts: the distribution of whole generations
  (`speculative_test`'s check)."""
  model = _model(seed=5, num_layers=2, vocab_size=exact_tests.VOCAB, streaming_layers=1,
                 streaming_adapter_rank=2)
  model.trunk.embedding.embedding[...] *= 4.0  # Sharpened, as in speculative_test.
  prompt = np.array([1, 5, 2], np.int32)
  prompts = np.broadcast_to(prompt, (exact_tests.ROWS, 3))
  exact = exact_tests._exact_distribution(model, prompt)  # pylint: disable=protected-access
  out = decode_testing.decode(model, prompts, max_new_tokens=exact_tests.NEW, seed=2,
                              **exact_tests.SAMPLING)
  assert exact_tests._chisquare_p(np.asarray(out.tokens), exact) > 1e-3  # pylint: disable=protected-access
  assert np.asarray(out.accepted_histogram)[:, 2:].sum() > exact_tests.ROWS // 20


def test_a_trained_streaming_model_drafts_most_of_its_tokens_exactly(counting_model):
  """Joint training on counting rows: the streams' drafts pass, and the output is greedy
  decoding's, chain and tree, batched, from prompts of different lengths."""
  prompts = np.array([[3, 4, 5, 6, 7], [20, 21, 22, 0, 0]], np.int32)
  lengths = np.array([5, 3], np.int32)
  plain = decode_testing.decode(counting_model, prompts, lengths, decoder='autoregressive',
                                max_new_tokens=20)
  for tree in (None, trees.tree_from_choices([(0,), (1,), (0, 0), (0, 0, 0)])):
    out = decode_testing.decode(counting_model, prompts, lengths, max_new_tokens=20, tree=tree,
                                drafters=['heads'])
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert np.all(out.mean_accepted > 2.5), out.mean_accepted
