"""Importing tiny synthetic GGUF files and Hugging Face directories into mtp workdirs."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp.pretrained import gguf_file
from mtp.pretrained import gguf_file_test
from mtp.pretrained import testing
from mtp.pretrained import workdir as workdir_lib
from mtp.pretrained.llama import PretrainedError


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], -1)


def reference_logits(t: dict[str, np.ndarray], shape, ids: list[int]) -> np.ndarray:
  """A Llama forward in float64 numpy, as Hugging Face's modeling_llama computes it (rotate_half
  rotary embedding, grouped-query attention, SwiGLU): one sequence of ids [T] -> logits [T, V]."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  n, hd, kvh, eps = len(ids), shape.head_dim, shape.num_kv_heads, shape.norm_eps
  inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, hd, 2) / hd)
  angles = np.arange(n)[:, None] * inv_freq[None]
  cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
  x = t['model.embed_tokens.weight'][ids]
  causal = np.tril(np.ones((n, n), bool))
  for i in range(shape.num_layers):
    p = f'model.layers.{i}.'
    h = _rms(x, t[p + 'input_layernorm.weight'], eps)
    q = (h @ t[p + 'self_attn.q_proj.weight'].T).reshape(n, -1, hd)
    k = (h @ t[p + 'self_attn.k_proj.weight'].T).reshape(n, kvh, hd)
    v = (h @ t[p + 'self_attn.v_proj.weight'].T).reshape(n, kvh, hd)
    q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    group = q.shape[1] // kvh
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum('qhd,khd->hqk', q, k) / np.sqrt(hd)
    scores = np.where(causal[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum('hqk,khd->qhd', weights, v).reshape(n, -1)
    x = x + attended @ t[p + 'self_attn.o_proj.weight'].T
    h = _rms(x, t[p + 'post_attention_layernorm.weight'], eps)
    gate, up = h @ t[p + 'mlp.gate_proj.weight'].T, h @ t[p + 'mlp.up_proj.weight'].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + 'mlp.down_proj.weight'].T
  x = _rms(x, t['model.norm.weight'], eps)
  out = t['model.embed_tokens.weight'] if shape.tie_embeddings else t['lm_head.weight']
  return x @ out.T


def _model_logits(loaded, ids):
  model = loaded.model
  tokens = jnp.asarray([ids], jnp.int32)
  hidden = model(tokens, jnp.arange(len(ids))[None])[0]
  return np.asarray(model.logits(hidden))[0]


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  """A quantised GGUF file and a Hugging Face directory holding exactly the values it stores."""
  root = tmp_path_factory.mktemp('sources')
  gguf_path = root / 'tiny.gguf'
  stored = testing.write_gguf(gguf_path, testing.random_tensors(seed=3),
                              types=gguf_file_test.TYPES, chat_template=testing.CHAT_TEMPLATE)
  # The Hugging Face layout of what the file stores, un-permuted independently of the importer.
  names = gguf_file.gguf_names(testing.SHAPE.num_layers)
  hf = {}
  for name, gguf_name in names.items():
    if gguf_name in stored:
      values = stored[gguf_name]
      if name.endswith(('q_proj.weight', 'k_proj.weight')):
        shape = testing.SHAPE
        heads = shape.num_attention_heads if 'q_proj' in name else shape.num_kv_heads
        values = gguf_file_test.unpermute_by_index(values, heads)
      hf[name] = values
  hf_dir = testing.write_hf_directory(root / 'hf', hf, num_shards=2,
                                      tokenizer_config={'chat_template': testing.CHAT_TEMPLATE})
  return gguf_path, hf_dir, hf


@pytest.fixture(scope='module')
def imported(sources, tmp_path_factory):
  gguf_path, hf_dir, _ = sources
  root = tmp_path_factory.mktemp('workdirs')
  return (workdir_lib.import_weights(gguf_path, root / 'from_gguf'),
          workdir_lib.import_weights(hf_dir, root / 'from_hf'))


def test_gguf_and_hf_imports_give_the_same_params(imported):
  a, b = (nnx.to_pure_dict(nnx.state(mtp.load(w).model)) for w in imported)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_logits_match_a_numpy_llama(imported, sources):
  loaded = mtp.load(imported[0])
  ids = loaded.tokenizer.encode('def the(x):\n    return x  = 12')[:24]
  expected = reference_logits(sources[2], testing.SHAPE, ids)
  got = _model_logits(loaded, ids)
  np.testing.assert_allclose(got, expected, atol=2e-4 * np.abs(expected).max())


def test_workdir_contents(imported, sources):
  workdir = imported[0]
  config = json.loads((workdir / 'config.json').read_text())
  assert config['model']['mtp_num_heads'] == 0
  assert config['model']['num_kv_heads'] == 2 and config['model']['vocab_size'] == 288
  record = config['pretrained']
  assert record['format'] == 'gguf' and record['path'] == str(sources[0])
  [file] = record['files']
  assert file['size'] == sources[0].stat().st_size and len(file['sha256']) == 64
  assert json.loads((workdir / 'special_tokens.json').read_text())['eos_id'] == 2
  hf_record = json.loads((imported[1] / 'config.json').read_text())['pretrained']
  assert hf_record['format'] == 'hf' and len(hf_record['files']) == 4  # config, tokenizer, shards
  loaded = mtp.load(workdir)
  assert loaded.step == 0 and loaded.tokenizer.special_ids == testing.SPECIAL_IDS
  assert not list(workdir.parent.glob('.*importing*'))


def test_chat_template_travels_in(imported):
  for workdir in imported:
    assert (workdir / 'chat_template.jinja').read_text() == testing.CHAT_TEMPLATE
    assert mtp.load(workdir).tokenizer.chat_template == testing.CHAT_TEMPLATE


def test_generate_from_an_imported_workdir(imported):
  [out] = mtp.generate(imported[0], 'def the', max_new_tokens=5, decoder='autoregressive')
  assert 1 <= len(out.tokens) <= 5


def test_existing_workdir_is_refused_and_untouched(sources, tmp_path):
  target = tmp_path / 'w'
  target.mkdir()
  (target / 'notes.txt').write_text('mine')
  with pytest.raises(PretrainedError, match='already exists and is not empty'):
    workdir_lib.import_weights(sources[0], target)
  assert [p.name for p in target.iterdir()] == ['notes.txt']
  empty = tmp_path / 'empty'
  empty.mkdir()
  assert (workdir_lib.import_weights(sources[0], empty) / 'config.json').exists()


def test_keeping_the_first_layers_imports_a_smaller_model_of_the_same_weights(sources, tmp_path):
  cut = workdir_lib.import_weights(sources[1], tmp_path / 'cut', num_layers=1)
  loaded = mtp.load(cut)
  assert loaded.config.model.num_layers == 1
  assert loaded.config.pretrained.num_layers_kept == 1
  ids = loaded.tokenizer.encode('def the(x):\n    return x')[:16]
  expected = reference_logits(sources[2], dataclasses.replace(testing.SHAPE, num_layers=1), ids)
  np.testing.assert_allclose(_model_logits(loaded, ids), expected,
                             atol=2e-4 * np.abs(expected).max())


@pytest.mark.parametrize('num_layers', [0, testing.SHAPE.num_layers + 1, True, 1.0])
def test_keeping_a_bad_number_of_layers_is_named_and_writes_nothing(sources, tmp_path, num_layers):
  with pytest.raises(PretrainedError, match=r'num_layers must be an integer in \[1, '):
    workdir_lib.import_weights(sources[0], tmp_path / 'w', num_layers=num_layers)
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('problem', ['missing tensor', 'truncated', 'not gguf', 'no such'])
def test_bad_sources_write_nothing(tmp_path, problem):
  source = tmp_path / 'src.gguf'
  if problem == 'missing tensor':
    testing.write_gguf(source, testing.random_tensors(), omit=('model.norm.weight',))
  elif problem == 'truncated':
    testing.write_gguf(source, testing.random_tensors())
    source.write_bytes(source.read_bytes()[:5000])
  elif problem == 'not gguf':
    source.write_text('hello')
  out = tmp_path / 'out' / 'w'
  with pytest.raises(PretrainedError):
    workdir_lib.import_weights(source, out)
  assert not (tmp_path / 'out').exists()


def test_heads_train_on_an_imported_trunk(imported, tmp_path):
  """init_from an imported workdir: its tokenizer and special ids are adopted, trunk frozen."""
  from configs import tiny
  from mtp.train import trainer as trainer_lib
  source = mtp.load(imported[0])
  config = tiny.get_config()
  config.mesh.data = 1
  for key, value in source.config.model.items():
    if key not in ('mtp_num_heads', 'mtp_head_type'):
      config.model[key] = value
  config.model.max_seq_len = 128
  config.data.seq_len = 32
  config.init_from = str(imported[0])
  config.optim.mode = 'frozen_trunk'
  config.num_train_steps = 2
  config.eval_steps = 0
  trainer_lib.train_and_evaluate(config, tmp_path)
  tuned = mtp.load(tmp_path)
  assert tuned.tokenizer.special_ids == testing.SPECIAL_IDS and tuned.model.mtp_num_heads == 3
  jax.tree.map(np.testing.assert_array_equal, nnx.state(source.model.trunk),
               nnx.state(tuned.model.trunk))


def test_smollm2_alias_uses_the_cache(tmp_path, monkeypatch):
  from mtp.pretrained import smollm2
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  monkeypatch.chdir(tmp_path)  # No local path named 'smollm2'.
  cached = tmp_path / 'mtp' / pathlib.Path(smollm2.MEMBER).name
  cached.parent.mkdir()
  cached.write_bytes(b'GGUF')
  assert workdir_lib.resolve_source('smollm2') == cached
  assert workdir_lib.resolve_source('other.gguf') == pathlib.Path('other.gguf')
