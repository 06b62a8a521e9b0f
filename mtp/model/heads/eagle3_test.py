"""EAGLE-3's options of the EAGLE drafter: fused features (`eagle_features='fused'`) and its
input layer (`eagle_input='concat'`).

Elsewhere: cached drafts equal the training forward for these options
(mtp/model/mtp_model_test.py, `VARIANTS`); exact greedy decoding, chains, trees, oracle and
ragged drafts, lookup and dynamic trees (mtp/decode/speculative_test.py, 'eagle3'); the FLOP
count against XLA's (mtp/train/flops_test.py).
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
from mtp.model import heads
from mtp.model import mtp_model
from mtp.model import testing
from mtp.model.heads import eagle
from mtp.model.heads import eagle3_torch_check
from mtp.model.heads import eagle_test
from mtp.train import distill
from mtp.train import testing as train_testing

K, VOCAB, D = 3, 61, 32
EAGLE3 = dict(eagle_features='fused', eagle_input='concat')


def _model(seed=0, num_layers=2, vocab_size=VOCAB, **options):
  cfg = dataclasses.replace(
      testing.tiny_config(mtp_num_heads=K, head_type='eagle', vocab_size=vocab_size,
                          num_layers=num_layers),
      head_options=tuple(sorted(options.items())))
  return mtp_model.MTPModel(cfg, rngs=nnx.Rngs(seed))


def _positions(b, t):
  return jnp.broadcast_to(jnp.arange(t), (b, t))


@pytest.mark.parametrize('options,message', [
    (dict(eagle_features='all'), r"model.eagle_features must be one of last, fused, got 'all'"),
    (dict(eagle_input='sum'), r"model.eagle_input must be one of fc, concat, got 'sum'"),
    (dict(eagle_features='fused', eagle_fused_layers='1,x'),
     'model.eagle_fused_layers must be comma-separated integers'),
    (dict(eagle_features='fused', eagle_fused_layers='1,1'),
     'model.eagle_fused_layers must be distinct layer indices >= 0 in increasing order'),
    (dict(eagle_features='fused', eagle_fused_layers='1,0'), 'increasing order'),
    (dict(eagle_features='fused', eagle_fused_layers='-1'), 'increasing order'),
    (dict(eagle_features='fused', eagle_fused_layers=[0, 1]),
     'model.eagle_fused_layers must be a string'),
    (dict(eagle_features='fused', eagle_fused_layers='0,2'),
     r'model.eagle_fused_layers names trunk layers \[0, 2\]; the trunk has layers 0..1'),
    (dict(eagle_fused_layers='0,1'), "eagle_fused_layers applies with "
     "model.eagle_features='fused' only"),
    (dict(eagle_feature_loss_weight=True), 'model.eagle_feature_loss_weight must be a finite'),
])
def test_bad_options_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    _model(**options)


@pytest.mark.parametrize('num_layers,layers', [
    (1, (0,)), (2, (0, 1)), (4, (1, 2)), (5, (2,)), (6, (2, 3)), (7, (2, 3, 4)),
    (32, (2, 16, 29))])
def test_default_fused_layers_are_eagle3s_clamped_into_the_trunk(num_layers, layers):
  cfg = testing.tiny_config(head_type='eagle', num_layers=num_layers).trunk
  options = {**eagle.EagleDrafter.OPTIONS, **EAGLE3}
  assert eagle.EagleDrafter.trunk_layer_inputs(cfg, K, options) == layers
  assert eagle.EagleDrafter.trunk_layer_inputs(
      cfg, K, {**options, 'eagle_fused_layers': '0'}) == (0,)
  assert eagle.EagleDrafter.trunk_layer_inputs(cfg, K, eagle.EagleDrafter.OPTIONS) == ()


def test_parameter_shapes():
  model = _model(num_layers=7, **EAGLE3)
  params = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(model.heads)))
  layer = params['layers'][0]
  assert set(params) == {'fuse', 'layers', 'norm'}  # No fc: EAGLE-3's layer reads [e; f].
  assert params['fuse']['kernel'] == (3 * D, D) and params['norm']['scale'] == (D,)
  assert set(layer) == {'input_norm', 'hidden_norm', 'attn', 'mlp_norm', 'mlp'}
  assert layer['attn'] == {'q_proj': {'kernel': (2 * D, 32)}, 'k_proj': {'kernel': (2 * D, 16)},
                           'v_proj': {'kernel': (2 * D, 16)}, 'o_proj': {'kernel': (32, D)}}
  assert layer['mlp'] == {'gate': {'kernel': (D, 64)}, 'up': {'kernel': (D, 64)},
                          'down': {'kernel': (64, D)}}
  assert model.cfg.trunk_layer_inputs == (2, 3, 4)
  assert model.num_cache_layers == 8 and model.num_verified_cache_layers == 7
  # Each option alone: fused features with EAGLE-1's fc, and EAGLE-3's layer on f_t.
  fused = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(
      _model(num_layers=7, eagle_features='fused', eagle_fused_layers='1,6').heads)))
  assert set(fused) == {'fc', 'fuse', 'layers'} and fused['fuse']['kernel'] == (2 * D, D)
  assert fused['fc']['kernel'] == (2 * D, D)
  last = _model(eagle_input='concat')
  assert set(nnx.to_pure_dict(nnx.state(last.heads))) == {'layers', 'norm'}
  assert last.cfg.trunk_layer_inputs == ()


def _layer_inputs_by_hand(model, tokens, positions):
  """{i: the residual stream entering trunk layer i}, running the blocks one by one."""
  trunk = model.trunk
  mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None, None]
  x, inputs = trunk.embed(tokens), {}
  for i in range(model.cfg.trunk.num_layers):
    inputs[i] = x
    x, _ = trunk.layer(i)(x, positions, mask)
  return inputs


def test_fused_features_are_fuse_over_the_concatenated_layer_inputs():
  """By hand: fuse.kernel over [u^2; u^3; u^4] of a 7-layer trunk; `verify` hands the same to
  drafting (prefill step), and the training forward's depth 1 reads them."""
  model = _model(num_layers=7, **EAGLE3)
  tokens = jnp.asarray(testing.random_tokens((2, 9), VOCAB, seed=2))
  positions = _positions(2, 9)
  inputs = _layer_inputs_by_hand(model, tokens, positions)
  kernel = np.asarray(model.heads.fuse.kernel[...])
  expected = np.concatenate([inputs[i] for i in (2, 3, 4)], axis=-1) @ kernel  # [B, T, D]
  out, _ = model.step(tokens, positions, model.init_cache(2, 16), jnp.zeros(2, jnp.int32))
  np.testing.assert_allclose(out.features, expected, atol=1e-5, rtol=1e-5)
  _, trained = model.trunk.train_forward(tokens, positions, None, (2, 3, 4))
  np.testing.assert_allclose(model.heads._first_features(None, trained), expected, atol=1e-5,
                             rtol=1e-5)
  # The training forward reads them: change the fuse and the drafter's outputs change, the
  # trunk's not.
  before = model(tokens, positions)
  model.heads.fuse.kernel[...] = model.heads.fuse.kernel[...] * 2
  after = model(tokens, positions)
  np.testing.assert_array_equal(after[0], before[0])
  assert not np.allclose(after[1], before[1], atol=1e-3)


def test_eagle3_layer_by_hand():
  """Depth 1 of the training forward, written out with the layer's parts (vLLM's
  llama_eagle3 order): h = f + attn([input_norm(e); hidden_norm(f)]),
  out = norm(h + mlp(mlp_norm(h))), with f the fused feature and e the next token's
  embedding."""
  model = _model(num_layers=4, **EAGLE3)
  heads, layer = model.heads, model.heads.layers[0]
  tokens = jnp.asarray(testing.random_tokens((2, 10), VOCAB, seed=5))
  positions = _positions(2, 10)
  inputs = _layer_inputs_by_hand(model, tokens, positions)
  f = heads.fuse(jnp.concatenate([inputs[1], inputs[2]], axis=-1))[:, :-1]
  e = model.trunk.embed(tokens[:, 1:])
  x = jnp.concatenate([layer.input_norm(e), layer.hidden_norm(f)], axis=-1)
  attended, _ = layer.attn(x, positions[:, :-1], jnp.tril(jnp.ones((9, 9), bool))[None, None])
  h = f + attended
  h = h + layer.mlp(layer.mlp_norm(h))
  out = model(tokens, positions)
  np.testing.assert_allclose(out[1, :, :9], heads.norm(h), atol=1e-5, rtol=1e-5)


def test_training_modes_and_causality():
  """Depth 1 is the same in both training modes; 'trunk' shifts it for deeper heads;
  'drafted' depths read their own outputs and stay causal: head k at t reads tokens up to
  t + k and nothing later."""
  tokens = jnp.asarray(testing.random_tokens((2, 12), VOCAB, seed=3))
  drafted = _model(**EAGLE3)
  trunk_fed = _model(eagle_train_features='trunk', **EAGLE3)
  out = drafted(tokens, _positions(2, 12))
  fed = trunk_fed(tokens, _positions(2, 12))
  assert out.shape == fed.shape == (K + 1, 2, 12, D)
  np.testing.assert_allclose(out[:2], fed[:2], atol=1e-5)
  for k in range(2, K + 1):
    np.testing.assert_allclose(fed[k, :, :12 - k + 1], fed[1, :, k - 1:], atol=1e-6)
    assert not np.allclose(out[k, :, :6], fed[k, :, :6], atol=1e-3)
  changed = tokens.at[:, 8].set((tokens[:, 8] + 1) % VOCAB)
  again = drafted(changed, _positions(2, 12))
  for k in range(1, K + 1):
    np.testing.assert_allclose(again[k, :, :8 - k], out[k, :, :8 - k], atol=1e-6)
    assert not np.allclose(again[k, :, 8 - k], out[k, :, 8 - k], atol=1e-4)


def test_greedy_decoding_with_a_draft_vocabulary_equals_autoregressive():
  """FR-Spec's draft vocabulary: EAGLE-3's drafts over N ids, fed back as full ids."""
  prompts = testing.random_tokens((3, 7), VOCAB, seed=1)
  lengths = np.array([7, 3, 5], np.int32)
  reference = decode_testing.decode(testing.tiny_model(0, mtp_num_heads=0), prompts, lengths,
                                    max_new_tokens=16, decoder='autoregressive')
  out = decode_testing.decode(_model(**EAGLE3), prompts, lengths, max_new_tokens=16,
                              draft_vocab=np.arange(0, VOCAB, 2, dtype=np.int32))
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)


def test_sampled_generations_follow_the_target_distribution():
  """Exact rejection sampling with EAGLE-3 drafts: the distribution of whole generations."""
  eagle_test.assert_sampling_follows_the_target(
      _model(seed=5, vocab_size=exact_tests.VOCAB, **EAGLE3))


# ------------------------------------------------------------------------------------------
# vLLM's EAGLE-3 format.
# ------------------------------------------------------------------------------------------


_perturbed, _context = eagle_test._perturbed, eagle_test._context  # EAGLE-1's export tests'.


def _source(model, sub, name='eagle3'):
  embedding = np.asarray(model.trunk.embedding.embedding[...])
  return heads.HFImportSource(
      config={}, trunk_cfg=model.cfg.trunk, embedding=embedding, unembedding=embedding,
      tensors={}, subdirectory=lambda n: sub if n == name else None, block_params=None)


def test_export_names_and_round_trip():
  model = _perturbed(_model(num_layers=7, **EAGLE3))
  export = model.heads.hf_export(_context(model))
  assert export.format == 'vllm-eagle3' and set(export.subdirectories) == {'eagle3'}
  sub = export.subdirectories['eagle3']
  config = sub.config
  assert config['architectures'] == ['LlamaForCausalLMEagle3']
  assert config['num_hidden_layers'] == 1 and config['num_speculative_tokens'] == K
  assert config['eagle_aux_hidden_state_layer_ids'] == [2, 3, 4]
  assert config['draft_vocab_size'] == config['vocab_size'] == VOCAB
  assert sub.tensors['fc.weight'].shape == (D, 3 * D)
  assert sub.tensors['midlayer.self_attn.q_proj.weight'].shape == (32, 2 * D)
  assert sub.tensors['midlayer.self_attn.k_proj.weight'].shape == (16, 2 * D)
  assert {'midlayer.input_layernorm.weight', 'midlayer.hidden_norm.weight',
          'midlayer.post_attention_layernorm.weight', 'midlayer.mlp.down_proj.weight',
          'norm.weight', 'lm_head.weight', 'embed_tokens.weight'} <= set(sub.tensors)
  imported = eagle.EagleDrafter.hf_import(_source(model, sub))
  assert imported.num_heads == K
  assert imported.options == {'eagle_features': 'fused', 'eagle_input': 'concat',
                              'eagle_fused_layers': '', 'eagle_feature_loss_weight': 0.0}
  jax.tree.map(np.testing.assert_array_equal, imported.params,
               nnx.to_pure_dict(nnx.state(model.heads)))
  # vLLM's own layer names, and other layers than the default ones.
  renamed = heads.HFSubdirectory(
      {**config, 'eagle_aux_hidden_state_layer_ids': [1, 3, 6]},
      {n.replace('midlayer.', 'layers.0.'): v for n, v in sub.tensors.items()})
  imported = eagle.EagleDrafter.hf_import(_source(model, renamed))
  assert imported.options['eagle_fused_layers'] == '1,3,6'
  jax.tree.map(np.testing.assert_array_equal, imported.params,
               nnx.to_pure_dict(nnx.state(model.heads)))


def test_a_trained_draft_vocabulary_exports_as_vllm_maps_it_and_imports_back():
  """lm_head holds the N drafted rows; draft index i is token i + d2t[i] (vLLM's mapping); the
  import reads the same ids back, in their order, as the heads' draft vocabulary."""
  model = _perturbed(_model(num_layers=7, **EAGLE3))
  ids = np.array([5, 0, 17, 3, 40, 9], np.int32)
  context = dataclasses.replace(_context(model), draft_ids=ids)
  sub = model.heads.hf_export(context).subdirectories['eagle3']
  assert sub.config['draft_vocab_size'] == 6 and sub.config['vocab_size'] == VOCAB
  d2t, t2d = sub.tensors['d2t'], sub.tensors['t2d']
  assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (VOCAB,)
  np.testing.assert_array_equal(np.arange(6) + d2t, ids)
  np.testing.assert_array_equal(np.flatnonzero(t2d), np.sort(ids))
  np.testing.assert_array_equal(sub.tensors['lm_head.weight'], context.unembedding[ids])
  imported = eagle.EagleDrafter.hf_import(_source(model, sub))
  assert imported.draft_ids.dtype == np.int32
  np.testing.assert_array_equal(imported.draft_ids, ids)
  jax.tree.map(np.testing.assert_array_equal, imported.params,
               nnx.to_pure_dict(nnx.state(model.heads)))
  # An identity d2t over the whole vocabulary is no draft vocabulary.
  whole = model.heads.hf_export(_context(model)).subdirectories['eagle3']
  whole.tensors['d2t'] = np.zeros(VOCAB, np.int64)
  assert eagle.EagleDrafter.hf_import(_source(model, whole)).draft_ids is None


def _with_draft_vocab(c, t, ids=(5, 0, 17)):
  """A drafter over `ids`' rows, as vLLM lays it out."""
  ids = np.asarray(ids)
  c.update(draft_vocab_size=len(ids))
  t.update({'d2t': ids - np.arange(len(ids)), 'lm_head.weight': t['lm_head.weight'][ids]})


@pytest.mark.parametrize('change,message', [
    (lambda c, t: (_with_draft_vocab(c, t), t.update(d2t=t['d2t'].astype(np.float32))),
     r'd2t must be \[3\] integers'),
    (lambda c, t: (_with_draft_vocab(c, t), t.update(d2t=t['d2t'][:2])), r'd2t must be \[3\]'),
    (lambda c, t: c.update(draft_vocab_size=32), 'no d2t tensor'),
    (lambda c, t: _with_draft_vocab(c, t, ids=(5, 5, 17)), 'one id twice'),
    (lambda c, t: (_with_draft_vocab(c, t), t.update(d2t=t['d2t'] + VOCAB)), 'outside'),
    (lambda c, t: (_with_draft_vocab(c, t), t.update(t2d=np.zeros(VOCAB, bool))),
     't2d does not mark'),
    (lambda c, t: (_with_draft_vocab(c, t), t.update({'lm_head.weight': t['lm_head.weight'][
        ::-1]})), 'lm_head.weight differs'),
])
def test_import_names_a_draft_vocabulary_it_cannot_map(change, message):
  model = _perturbed(_model(num_layers=7, **EAGLE3))
  sub = model.heads.hf_export(_context(model)).subdirectories['eagle3']
  config, tensors = dict(sub.config), dict(sub.tensors)
  change(config, tensors)
  with pytest.raises(ValueError, match=message):
    eagle.EagleDrafter.hf_import(_source(model, heads.HFSubdirectory(config, tensors)))


@pytest.mark.parametrize('change,message', [
    (lambda c, t: c.update(norm_before_residual=True), 'norm_before_residual'),
    (lambda c, t: t.update({'midlayer.self_attn.q_proj.bias': np.zeros(32, np.float32)}),
     'midlayer.self_attn.q_proj.bias is not part of'),
    (lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 9]), 'are not three '
     'increasing layers'),
    (lambda c, t: t.update({'lm_head.weight': t['lm_head.weight'] + 1}), 'lm_head.weight '
     'differs'),
    (lambda c, t: t.pop('midlayer.hidden_norm.weight'), 'missing tensor '
     'midlayer.hidden_norm.weight'),
])
def test_import_refuses_what_the_drafter_cannot_hold(change, message):
  model = _model(num_layers=7, **EAGLE3)
  sub = model.heads.hf_export(_context(model)).subdirectories['eagle3']
  change(sub.config, sub.tensors)
  with pytest.raises(ValueError, match=message):
    eagle.EagleDrafter.hf_import(_source(model, sub))


@pytest.mark.parametrize('options', [
    dict(eagle_features='fused'), dict(eagle_input='concat'), EAGLE3])
def test_options_without_a_vllm_layout_are_named(options):
  model = _model(**options)  # 2 layers: EAGLE3 fuses two layers here, vLLM three.
  with pytest.raises(NotImplementedError, match="vLLM has a layout for EAGLE-1 .* and for "
                     "EAGLE-3 .* only"):
    model.heads.hf_export(_context(model))


def test_hf_export_matches_vllm_eagle3_in_torch(tmp_path):
  """The whole path: `mtp.export.hf.write` (Llama directory + eagle3/), then transformers' Llama
  of the export gives the auxiliary hidden states (its hidden_states[i] enters layer i, vLLM's
  id i), and vLLM's Eagle3LlamaForCausalLM forward, written with transformers' Llama parts
  from eagle3/'s tensors (`eagle3_torch_check`, in a process of its own: torch never loads
  here),
  equals the drafter's depth 1; `import_weights` reads it all back."""
  mtp_testing.require('torch', 'transformers')
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp import api  # pylint: disable=import-outside-toplevel
  from mtp.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from mtp.export import hf  # pylint: disable=import-outside-toplevel
  from mtp.pretrained import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizer_lib.byte_tokenizer()
  config = train_testing.tiny_config(**{'model.mtp_head_type': 'eagle', 'model.num_layers': 3,
                                        'model.eagle_features': 'fused',
                                        'model.eagle_input': 'concat'})
  config.model.vocab_size = -(-tokenizer.vocab_size // 8) * 8 + 8
  model = _perturbed(mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config.model),
                                        rngs=nnx.Rngs(0)))
  loaded = api.LoadedModel(model=model, tokenizer=tokenizer, config=config, step=0,
                           workdir=tmp_path / 'unused')
  (tmp_path / 'export').mkdir()
  summary = hf.write(loaded, tmp_path / 'export', np.float32)
  assert summary['heads']['format'] == 'vllm-eagle3'
  sub = tmp_path / 'export' / 'eagle3'
  assert sorted(p.name for p in sub.iterdir()) == ['config.json', 'model.safetensors']

  tokens = testing.random_tokens((1, 10), config.model.vocab_size, seed=9)
  with mtp_testing.oracle_process('torch', 'transformers') as oracle:
    torch_out = oracle.submit(eagle3_torch_check.drafter_outputs, tmp_path / 'export',
                              tokens).result()
  assert list(torch_out['aux_ids']) == [0, 1, 2]
  expected = model(jnp.asarray(tokens), _positions(1, 10))  # [K+1, 1, T, D]
  np.testing.assert_allclose(torch_out['normed'], np.asarray(expected[1, :, :9]), atol=1e-4)
  np.testing.assert_allclose(torch_out['logits'], np.asarray(model.logits(expected[1, :, :9])),
                             atol=1e-4)

  back = mtp.load(workdir_lib.import_weights(tmp_path / 'export', tmp_path / 'w'))
  assert back.model.cfg.mtp_head_type == 'eagle' and back.model.mtp_num_heads == K
  assert back.model.cfg.options['eagle_features'] == 'fused'
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)),
               nnx.to_pure_dict(nnx.state(back.model)))


def test_a_trunk_cache_keeps_the_fused_layers_inputs(tiny_workdir, tmp_path):
  """A frozen trunk's cache stores the fused layers' inputs beside its last state, and the
  drafter trains on them as on the trunk's own pass: the same losses."""
  from mtp.train import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from mtp.train import trunk_cache_test  # pylint: disable=import-outside-toplevel
  options = {'model.mtp_head_type': 'eagle', 'model.eagle_features': 'fused',
             'model.eagle_input': 'concat', 'model.eagle_feature_loss_weight': 0.0}
  plain = trunk_cache_test._heads_config(tiny_workdir, **options)
  cached = trunk_cache_test._heads_config(tiny_workdir, **options,
                                          **{'distill.cache_trunk_states': True})
  layers = mtp_model.ModelConfig.from_config(cached.model).trunk_layer_inputs
  assert layers and distill.cached_layer_inputs(cached) == layers
  trainer_lib.train_and_evaluate(plain, tmp_path / 'plain')
  trainer_lib.train_and_evaluate(cached, tmp_path / 'cached')
  np.testing.assert_allclose(trunk_cache_test._losses(tmp_path / 'cached'),
                             trunk_cache_test._losses(tmp_path / 'plain'), rtol=2e-5)
  [directory] = (tmp_path / 'cached' / 'trunk_cache').iterdir()
  assert 'trunk_layer_inputs.npy' in [p.name for p in directory.iterdir()]


def test_a_draft_vocabulary_is_kept_in_the_workdir_and_travels_through_export(tmp_path,
                                                                                monkeypatch):
  """Training keeps the heads' draft ids in the workdir: decoding and export read them there,
  with no corpus to count, and `import_weights` of the vLLM export (d2t) keeps the same ids,
  so the imported drafter drafts over them, exactly."""
  import mtp  # pylint: disable=import-outside-toplevel
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  from mtp.decode import draft_vocab  # pylint: disable=import-outside-toplevel
  from mtp.decode import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from mtp.export import hf  # pylint: disable=import-outside-toplevel
  from mtp.pretrained import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  from mtp.train import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from mtp.train import trunk_cache_test  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  # Three trunk layers: vLLM's EAGLE-3 layout fuses three.
  trainer_lib.train_and_evaluate(train_testing.tiny_config(**{
      'model.num_layers': 3, 'num_train_steps': 1, 'eval_steps': 0, 'mesh.data': 1}),
                                 tmp_path / 'base')
  config = trunk_cache_test._heads_config(tmp_path / 'base', **{
      'model.num_layers': 3, 'model.mtp_head_type': 'eagle', 'model.eagle_features': 'fused',
      'model.eagle_input': 'concat', 'model.eagle_feature_loss_weight': 0.0,
      'mtp_head_draft_vocab': 40, 'distill.targets': 'teacher'})
  trainer_lib.train_and_evaluate(config, tmp_path / 'heads')
  loaded = mtp.load(tmp_path / 'heads')
  vocab_size = loaded.model.cfg.trunk.vocab_size
  kept = checkpointing.load_draft_ids(tmp_path / 'heads', vocab_size)
  counted = draft_vocab.corpus_draft_vocabulary(loaded.config, loaded.tokenizer, vocab_size, 40)
  np.testing.assert_array_equal(kept, counted)
  # The kept ids win over the corpus: a changed (here unreadable) corpus changes nothing.
  loaded.config.data.corpus = 'no_such_corpus'
  np.testing.assert_array_equal(draft_vocab.draft_vocabulary(loaded, 40), kept)
  # A resumed run with another size is refused, naming the file.
  config.mtp_head_draft_vocab = 30
  with pytest.raises(ValueError, match='40 ids of its draft_vocab.json'):
    trainer_lib.train_and_evaluate(config, tmp_path / 'heads')

  (tmp_path / 'export').mkdir()
  hf.write(loaded, tmp_path / 'export', np.float32)
  back = mtp.load(workdir_lib.import_weights(tmp_path / 'export', tmp_path / 'imported'))
  assert back.config.mtp_head_draft_vocab == 40
  np.testing.assert_array_equal(checkpointing.load_draft_ids(back.workdir, vocab_size), kept)
  back.config.data.corpus = 'no_such_corpus'  # Nothing is counted.
  resolved = plan_lib.resolve(back, 'speculative', max_new_tokens=8)
  assert resolved.plan.draft_vocab_size == 40
  prompts = ['def f(x):\n    return', 'import os\n']
  drafted = mtp.generate(back, prompts, max_new_tokens=12, decoder='speculative')
  plain = mtp.generate(loaded, prompts, max_new_tokens=12, decoder='autoregressive')
  assert [g.tokens for g in drafted] == [g.tokens for g in plain]


def test_a_corrupt_draft_vocabulary_file_is_named(tmp_path):
  from mtp.checkpoint import checkpointing  # pylint: disable=import-outside-toplevel
  path = tmp_path / checkpointing.DRAFT_IDS_FILENAME
  assert checkpointing.load_draft_ids(tmp_path, 10) is None
  for text, message in [('{"ids": [1, 2', 'is not a draft vocabulary'),
                        ('{"ids": []}', 'non-empty list'), ('{"ids": [1, 1]}', 'distinct'),
                        ('{"ids": [3, 10]}', r'\[0, 10\)'), ('[1, 2]', 'not a draft')]:
    path.write_text(text)
    with pytest.raises(checkpointing.CheckpointError, match=message):
      checkpointing.load_draft_ids(tmp_path, 10)
  checkpointing.save_draft_ids(tmp_path, np.array([4, 0, 7], np.int32))
  np.testing.assert_array_equal(checkpointing.load_draft_ids(tmp_path, 10), [4, 0, 7])


# ------------------------------------------------------------------------------------------
# Training on a toy task.
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def counting():
  """configs/tiny.py with an EAGLE-3 drafter trained jointly on counting rows (token t+1+j is
  token t plus 1+j), without the feature loss: (losses before, losses after, the model)."""
  config = train_testing.tiny_config(**{
      'model.mtp_head_type': 'eagle', 'model.eagle_features': 'fused',
      'model.eagle_input': 'concat', 'model.eagle_feature_loss_weight': 0.0,
      'model.vocab_size': 32, 'optim.warmup_steps': 5, 'optim.learning_rate': 1e-2,
      'num_train_steps': 40})
  return train_testing.train_on_counting(config)


def test_joint_training_lowers_the_drafter_losses(counting):
  before, after, model = counting
  assert model.cfg.options['eagle_features'] == 'fused'
  assert not any('feature_loss' in key for key in after)
  for k in (1, 2, 3):
    assert after[f'head_{k}_loss'] < 0.5 * before[f'head_{k}_loss'], (k, before, after)


def test_a_trained_eagle3_drafter_drafts_most_tokens_exactly(counting):
  """Greedy output is autoregressive decoding's, and most drafts pass."""
  _, _, model = counting
  prompts = np.array([[3, 4, 5, 6, 7], [20, 21, 22, 0, 0]], np.int32)
  lengths = np.array([5, 3], np.int32)
  plain = decode_testing.decode(model, prompts, lengths, decoder='autoregressive',
                                max_new_tokens=20)
  out = decode_testing.decode(model, prompts, lengths, max_new_tokens=20, drafters=['heads'])
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert np.all(out.mean_accepted > 2.0), out.mean_accepted
