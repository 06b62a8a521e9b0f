"""The EAGLE drafter: options, training forward, drafts, exact decoding, its vLLM format.

Cached drafts equal the training forward on the same text in mtp/model/mtp_model_test.py
(parametrized over every registered family); here: what is particular to EAGLE.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import testing as mtp_testing
from mtp.decode import speculative_test as exact_tests
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import heads
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model.heads import eagle
from mtp.model.heads import eagle_torch_check
from mtp.train import loss as loss_lib

K, VOCAB = 3, 61


def _model(seed=0, vocab_size=VOCAB, **options):
  cfg = dataclasses.replace(testing.tiny_config(mtp_num_heads=K, head_type='eagle',
                                                vocab_size=vocab_size),
                            head_options=tuple(sorted(options.items())))
  return mtp_model.MTPModel(cfg, rngs=nnx.Rngs(seed))


def _positions(b, t):
  return jnp.broadcast_to(jnp.arange(t), (b, t))


@pytest.mark.parametrize('options,message', [
    ({'eagle_train_features': 'teacher'}, 'model.eagle_train_features must be one of drafted, '
     'trunk'),
    ({'eagle_feature_loss_weight': -1.0}, 'model.eagle_feature_loss_weight must be a finite'),
    ({'eagle_feature_loss_weight': float('nan')}, 'eagle_feature_loss_weight must be a finite'),
])
def test_bad_options_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    _model(**options)


def test_one_shared_layer_and_one_cache_layer():
  model = _model()
  params = nnx.to_pure_dict(nnx.state(model.heads))
  assert set(params) == {'fc', 'layers'} and set(params['layers']) == {0}
  assert params['fc']['kernel'].shape == (64, 32)
  assert 'attn_norm' not in params['layers'][0]  # EAGLE's layer has no input norm.
  assert model.num_cache_layers == 3 and model.num_verified_cache_layers == 2
  assert model.feature_loss_weight == 1.0
  assert testing.tiny_model(head_type='medusa').feature_loss_weight == 0.0


def test_training_forward_rolls_one_layer_forward():
  """Depth 1 is the same in both training modes; 'trunk' shifts it for deeper heads; 'drafted'
  heads are causal: head k at t reads tokens up to t + k and nothing later."""
  tokens = jnp.asarray(testing.random_tokens((2, 12), VOCAB, seed=3))
  drafted = _model(eagle_train_features='drafted')
  trunk_fed = _model(eagle_train_features='trunk')
  out = drafted(tokens, _positions(2, 12))
  fed = trunk_fed(tokens, _positions(2, 12))
  assert out.shape == fed.shape == (K + 1, 2, 12, 32)
  np.testing.assert_allclose(out[:2], fed[:2], atol=1e-5)
  for k in range(2, K + 1):
    np.testing.assert_allclose(fed[k, :, :12 - k + 1], fed[1, :, k - 1:], atol=1e-6)
    assert not np.allclose(out[k, :, :6], fed[k, :, :6], atol=1e-3)  # Its own features.
  changed = tokens.at[:, 8].set((tokens[:, 8] + 1) % VOCAB)
  again = drafted(changed, _positions(2, 12))
  for k in range(1, K + 1):
    np.testing.assert_allclose(again[k, :, :8 - k], out[k, :, :8 - k], atol=1e-6)
    assert not np.allclose(again[k, :, 8 - k], out[k, :, 8 - k], atol=1e-4)


def test_feature_loss_joins_the_token_loss_and_trains_the_drafter_only():
  model = _model()
  tokens = jnp.asarray(testing.random_tokens((2, 12), VOCAB, seed=4))
  segments = jnp.asarray(np.repeat([[1] * 7 + [2] * 5], 2, 0), jnp.int32)

  def loss(params, weight):
    merged = nnx.merge(nnx.graphdef(model), params)
    hidden = merged(tokens, _positions(2, 12), segments)
    return loss_lib.mtp_loss(hidden, merged.unembedding(), tokens, segments,
                             loss_scaling_factor=1.0, weights=[1.0] * K, chunk_size=0,
                             feature_loss_weight=weight)

  params = nnx.state(model)
  plain, with_features = loss(params, 0.0), loss(params, 2.0)
  assert 'feature_loss' not in plain.metrics
  features = [with_features.metrics[f'head_{k}_feature_loss'] for k in range(1, K + 1)]
  assert all(f > 0 for f in features)
  np.testing.assert_allclose(with_features.total, plain.total + 2.0 * sum(features), rtol=1e-5)
  # The trunk's features are targets only: no gradient flows into them from the regression.
  hidden = model(tokens, _positions(2, 12), segments)
  grads = jax.grad(lambda h: jnp.sum(loss_lib.feature_regression(h, segments)))(hidden)
  assert not np.any(grads[0]) and all(np.any(g) for g in grads[1:])
  # Head k's target at t is the trunk's state at t + k, within the document: by hand.
  k, t = 2, 3
  expected = np.mean(np.asarray(loss_lib.smooth_l1(hidden[k, :, t] - hidden[0, :, t + k])))
  by_position = loss_lib.feature_regression(hidden[:, :, t:t + k + 1],
                                            segments[:, t:t + k + 1])
  np.testing.assert_allclose(by_position[k - 1], expected, rtol=1e-5)
  assert loss_lib.feature_regression(hidden[:, :, 5:9], segments[:, 5:9])[K - 1] == 0  # Crosses.


@pytest.fixture(scope='module')
def decoding():
  ar_model = testing.tiny_model(0, mtp_num_heads=0)
  model = testing.tiny_model(0, head_type='eagle', mtp_num_heads=K)
  prompts = testing.random_tokens((3, 7), VOCAB, seed=1)
  lengths = np.array([7, 3, 5], np.int32)
  reference = decode_testing.decode(ar_model, prompts, lengths, decoder='autoregressive',
                                    max_new_tokens=24)
  return model, prompts, lengths, reference


@pytest.mark.parametrize('tree', [K, exact_tests.TREE], ids=['chain', 'tree'])
def test_greedy_decoding_equals_autoregressive(decoding, tree):
  """Ragged prompts; the drafter's own drafts, then all-right (oracle) and ragged drafts, which
  move the accepted run through the drafter's cache layer at every length."""
  model, prompts, lengths, reference = decoding
  resolved = trees.static_tree(tree, K)
  hook = exact_tests.ReferenceDrafts(resolved, VOCAB)
  ref = np.asarray(reference.tokens)
  for mode in (exact_tests.MODEL_DRAFTS, exact_tests.ORACLE, exact_tests.RAGGED):
    out = decode_testing.decode(model, prompts, lengths, max_new_tokens=24, tree=tree,
                                draft_hook=hook, hook_data=exact_tests._hook_data(ref, mode))
    np.testing.assert_array_equal(out.tokens, ref)
    np.testing.assert_array_equal(out.num_generated, reference.num_generated)


def test_sampled_generations_follow_the_target_distribution():
  """Exact rejection sampling with EAGLE drafts: the distribution of whole generations."""
  assert_sampling_follows_the_target(_model(seed=5, vocab_size=exact_tests.VOCAB))


def assert_sampling_follows_the_target(model, **options):
  """Sampled generations of `model` (its drafts accepted by rejection sampling; `options` of
  `decode_testing.decode`, such as a tree) follow the exact distribution of whole
  generations, and deep drafts were accepted."""
  model.trunk.embedding.embedding[...] *= 4.0  # Sharpened, as in speculative_test.
  prompt = np.array([1, 5, 2], np.int32)
  prompts = np.broadcast_to(prompt, (exact_tests.ROWS, 3))
  exact = exact_tests._exact_distribution(model, prompt)
  out = decode_testing.decode(model, prompts, max_new_tokens=exact_tests.NEW, seed=2,
                              **exact_tests.SAMPLING, **options)
  assert exact_tests._chisquare_p(np.asarray(out.tokens), exact) > 1e-3
  assert np.asarray(out.accepted_histogram)[:, 2:].sum() > exact_tests.ROWS // 20


# ------------------------------------------------------------------------------------------
# vLLM's EAGLE-1 format.
# ------------------------------------------------------------------------------------------


def _perturbed(model):
  """Every parameter of the drafter moved off its initial value, norms included."""
  rng = np.random.default_rng(7)
  for _, param in nnx.iter_graph(model.heads):
    if isinstance(param, nnx.Param):
      param[...] = param[...] + rng.normal(0, 0.2, param[...].shape).astype(np.float32)
  return model


def _context(model):
  embedding = np.asarray(model.trunk.embedding.embedding[...])
  return heads.HFExportContext(trunk_cfg=model.cfg.trunk, embedding=embedding,
                               unembedding=embedding, block_tensors=None)


def _source(model, export):
  sub = export.subdirectories['eagle']
  embedding = np.asarray(model.trunk.embedding.embedding[...])
  return heads.HFImportSource(
      config={}, trunk_cfg=model.cfg.trunk, embedding=embedding, unembedding=embedding,
      tensors={}, subdirectory=lambda name: sub if name == 'eagle' else None, block_params=None)


def test_export_names_and_round_trip():
  model = _perturbed(_model())
  export = model.heads.hf_export(_context(model))
  sub = export.subdirectories['eagle']
  assert export.format == 'vllm-eagle' and not export.tensors and not export.config
  assert sub.config['architectures'] == ['LlamaForCausalLM']
  assert sub.config['num_hidden_layers'] == 1 and sub.config['num_speculative_tokens'] == K
  assert sub.tensors['fc.weight'].shape == (32, 64)
  assert 'layers.0.input_layernorm.weight' not in sub.tensors
  assert {'layers.0.self_attn.q_proj.weight', 'layers.0.post_attention_layernorm.weight',
          'layers.0.mlp.down_proj.weight', 'embed_tokens.weight'} <= set(sub.tensors)
  imported = eagle.EagleDrafter.hf_import(_source(model, export))
  assert imported.num_heads == K
  original = nnx.to_pure_dict(nnx.state(model.heads))
  jax.tree.map(np.testing.assert_array_equal, imported.params, original)
  assert eagle.EagleDrafter.hf_import(dataclasses.replace(
      _source(model, export), subdirectory=lambda name: None)) is None
  sub.tensors['fc.bias'] = np.zeros(32, np.float32)
  with pytest.raises(ValueError, match='eagle/: fc.bias is not part of'):
    eagle.EagleDrafter.hf_import(_source(model, export))
  del sub.tensors['fc.bias']
  sub.tensors['embed_tokens.weight'] = sub.tensors['embed_tokens.weight'] + 1
  with pytest.raises(ValueError, match='embed_tokens.weight differs'):
    eagle.EagleDrafter.hf_import(_source(model, export))


def test_vllm_eagle_forward_in_torch_matches_depth_one():
  """vLLM's EagleLlamaForCausalLM, written with transformers' Llama layer
  (`eagle_torch_check`, in a process of its own): fc over [embedding; target hidden after its
  final norm], one layer without input norm, no final norm, the target's lm_head. It equals the
  drafter's depth 1."""
  model = _perturbed(_model())
  sub = model.heads.hf_export(_context(model)).subdirectories['eagle']
  tokens = testing.random_tokens((1, 10), VOCAB, seed=9)
  expected = model(jnp.asarray(tokens), _positions(1, 10))  # [K+1, 1, T, D]
  with mtp_testing.oracle_process('torch', 'transformers') as oracle:
    out, logits = oracle.submit(
        eagle_torch_check.depth_one, dict(sub.config),
        {name: np.array(value) for name, value in sub.tensors.items()}, tokens,
        np.array(expected[0])).result()
  np.testing.assert_allclose(out, np.asarray(expected[1, :, :9]), atol=1e-4)
  np.testing.assert_allclose(logits, np.asarray(model.logits(expected[1, :, :9])), atol=1e-4)


def test_hf_export_and_import_weights_round_trip(tmp_path):
  """The whole path users take: `mtp.export.hf.write` (Llama directory + eagle/), then
  `import_weights` finds the drafter through `hf_import`: trunk and drafter bit for bit."""
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp import api  # pylint: disable=import-outside-toplevel
  from mtp.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from mtp.export import hf  # pylint: disable=import-outside-toplevel
  from mtp.pretrained import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  from mtp.train import testing as train_testing  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizer_lib.byte_tokenizer()
  config = train_testing.tiny_config(**{'model.mtp_head_type': 'eagle',
                                        'model.eagle_train_features': 'trunk'})
  config.model.vocab_size = -(-tokenizer.vocab_size // 8) * 8 + 8
  model = _perturbed(mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config.model),
                                        rngs=nnx.Rngs(0)))
  loaded = api.LoadedModel(model=model, tokenizer=tokenizer, config=config, step=0,
                           workdir=tmp_path / 'unused')
  (tmp_path / 'export').mkdir()
  summary = hf.write(loaded, tmp_path / 'export', np.float32)
  assert summary['heads']['format'] == 'vllm-eagle'
  assert sorted(p.name for p in (tmp_path / 'export' / 'eagle').iterdir()) == [
      'config.json', 'model.safetensors']
  back = mtp.load(workdir_lib.import_weights(tmp_path / 'export', tmp_path / 'w'))
  assert back.model.cfg.mtp_head_type == 'eagle'
  assert back.model.mtp_num_heads == model.mtp_num_heads
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)),
               nnx.to_pure_dict(nnx.state(back.model)))
