"""The Hugging Face export against its consumers: transformers (model, tokenizer, generation),
our own importer (round trip), and independent torch implementations of the heads' formats.

Models are tiny and random (every parameter perturbed, so a transposed or swapped tensor cannot
pass by symmetry): one per head family, with a byte tokenizer or a BPE one with a chat template,
tied or untied output layers, and sharded weights. The torch references of the heads' formats
(`mtp/model/heads/formats_torch_check.py`) are written from the published formats (vLLM's Medusa
ResBlocks, DeepSeek-V3's MTP layer, the parallel-heads layout in `mtp/model/heads/parallel.py`),
not from our modules.

transformers and torch come with the `peer` extra; the tests that need them skip without it,
and run them in a process of their own: this one never imports torch.
"""

import json
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp import api
from mtp import testing as mtp_testing
from mtp.checkpoint import checkpointing
from mtp.data import tokenizer as tokenizer_lib
from mtp.export import ExportError
from mtp.export import hf
from mtp.export import hf_torch_check
from mtp.model import heads as heads_lib
from mtp.model import mtp_model
from mtp.model.heads import formats_torch_check
from mtp.model.heads import medusa
from mtp.pretrained import safetensors_file
from mtp.pretrained import testing as pretrained_testing
from mtp.pretrained import workdir as workdir_lib
from mtp.pretrained.llama import PretrainedError
from mtp.train import testing

STDLIB = pathlib.Path(sysconfig.get_paths()['stdlib'])
PROSE = ('The quick brown fox jumps over the lazy dog. "Well," she said, it\'s not what we '
         'expected -- is it? Prices rose 3.5% in 2024; naïve café owners in Zürich noticed.\n\n'
         'A second paragraph, with  two spaces, a tab\there, and a final line.\n')
CHAT = pretrained_testing.CHAT_TEMPLATE
# family -> (config overrides, tokenizer kind, max_shard_bytes)
CASES = {
    'medusa': ({'model.medusa_num_layers': 2}, 'byte', hf.DEFAULT_MAX_SHARD_BYTES),
    'sequential': ({}, 'bpe', 100_000),  # Sharded: the trunk and MTP layers over many files.
    'parallel': ({'model.tie_embeddings': False}, 'byte', hf.DEFAULT_MAX_SHARD_BYTES),
    'streaming': ({'model.streaming_adapter_rank': 2, 'model.streaming_layers': 1}, 'byte',
                  hf.DEFAULT_MAX_SHARD_BYTES),
}


def _texts() -> dict[str, str]:
  code = (STDLIB / 'textwrap.py').read_text()[:3000]
  license_file = STDLIB / 'LICENSE.txt'
  prose = license_file.read_text()[:3000] if license_file.exists() else PROSE
  return {'code': code, 'prose': PROSE + prose,
          'unicode': 'emoji 🙂 日本語 e\u0301 Ελληνικά'}


@pytest.fixture(scope='module')
def bpe_tokenizer():
  files = ['textwrap.py', 'string.py', 'shlex.py', 'glob.py']
  trained = tokenizer_lib.train_bpe([(STDLIB / f).read_text() for f in files] + [PROSE],
                                    vocab_size=600)
  return tokenizer_lib.Tokenizer(trained.hf_tokenizer, trained.special_ids, chat_template=CHAT)


def _perturbed(model: mtp_model.MTPModel, seed: int) -> None:
  """Adds noise to every parameter in place: norms and biases leave 1 and 0, Medusa's zero
  ResBlocks come alive."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = []
  for key, leaf in zip(keys, leaves):
    scale = 0.2 if leaf.ndim == 1 else 0.5 / np.sqrt(leaf.shape[0])
    noisy.append(leaf + scale * jax.random.normal(key, leaf.shape, leaf.dtype))
  nnx.update(model, jax.tree.unflatten(treedef, noisy))


def _loaded(family: str, bpe_tokenizer, seed: int = 0) -> api.LoadedModel:
  overrides, kind, _ = CASES[family]
  tokenizer = tokenizer_lib.byte_tokenizer() if kind == 'byte' else bpe_tokenizer
  config = testing.tiny_config(**{'model.mtp_head_type': family, **overrides})
  # Spare output rows past the tokenizer's vocabulary, as configs/tiny.py has.
  config.model.vocab_size = -(-tokenizer.vocab_size // 8) * 8 + 8
  model = mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config.model), rngs=nnx.Rngs(seed))
  _perturbed(model, seed)
  return api.LoadedModel(model=model, tokenizer=tokenizer, config=config, step=0,
                             workdir=pathlib.Path('unused'))


@pytest.fixture(scope='module')
def exports(bpe_tokenizer, tmp_path_factory):
  """family -> (LoadedModel, export directory, write's summary)."""
  out = {}
  for family, (_, _, max_shard_bytes) in CASES.items():
    loaded = _loaded(family, bpe_tokenizer)
    directory = tmp_path_factory.mktemp(family)
    out[family] = loaded, directory, hf.write(loaded, directory, np.float32,
                                              max_shard_bytes=max_shard_bytes)
  return out


def _ours(loaded, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(logits [K+1, B, T, V] of the trunk and every head, h_0 [B, T, D] before the final norm)."""
  model = loaded.model
  tokens = jnp.asarray(tokens)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  hidden, _ = model.trunk(tokens, positions)
  return np.asarray(model.logits(model(tokens, positions))), np.asarray(hidden)


def _tokens(loaded, length: int = 48) -> np.ndarray:
  texts = _texts()
  return np.asarray([loaded.tokenizer.encode(texts[k])[:length] for k in ('code', 'prose')],
                    np.int32)


# ------------------------------------------------------------------------------------------
# Without transformers: files, round trip, errors.
# ------------------------------------------------------------------------------------------

def test_directory_contents(exports):
  _, directory, summary = exports['sequential']
  index = json.loads((directory / hf.INDEX).read_text())
  shards = sorted(set(index['weight_map'].values()))
  assert len(shards) > 2 and all((directory / s).is_file() for s in shards)
  assert not (directory / hf.WEIGHTS).exists()
  assert summary['files'] == {str(p.relative_to(directory)): p.stat().st_size
                              for p in directory.rglob('*') if p.is_file()}
  assert summary['heads'] == {'family': 'sequential', 'num_heads': 3, 'format': 'deepseek-v3-mtp',
                              'tensors_in_llama_directory': 3 * 14 + 1, 'subdirectories': []}
  config = json.loads((directory / 'config.json').read_text())
  assert config['num_nextn_predict_layers'] == 3 and config['tie_word_embeddings']
  assert (directory / 'chat_template.jinja').read_text() == CHAT
  generation = json.loads((directory / 'generation_config.json').read_text())
  loaded = exports['sequential'][0]
  assert generation['suppress_tokens'] == [0, *range(loaded.tokenizer.vocab_size,
                                                     loaded.model.cfg.trunk.vocab_size)]
  medusa_dir = exports['medusa'][1] / 'medusa'
  assert sorted(p.name for p in medusa_dir.iterdir()) == ['config.json', 'model.safetensors']
  assert not (exports['parallel'][1] / 'chat_template.jinja').exists()


@pytest.mark.parametrize('family', list(CASES))
def test_import_weights_reads_the_export_back(exports, family, tmp_path):
  """Trunk and heads, bit for bit; the heads found by their family's `hf_import`."""
  loaded, directory, _ = exports[family]
  back = mtp.load(workdir_lib.import_weights(directory, tmp_path / 'w'))
  assert back.model.cfg == loaded.model.cfg  # Head family, K and options included.
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(loaded.model)),
               nnx.to_pure_dict(nnx.state(back.model)))
  assert back.tokenizer.special_ids == loaded.tokenizer.special_ids
  assert back.tokenizer.chat_template == loaded.tokenizer.chat_template
  assert back.tokenizer.to_json() == loaded.tokenizer.to_json()


def test_bfloat16_export_reads_back_rounded(exports, tmp_path):
  import ml_dtypes
  loaded = exports['medusa'][0]
  directory = tmp_path / 'bf16'
  directory.mkdir()
  hf.write(loaded, directory, 'bfloat16')
  for path in (directory / hf.WEIGHTS, directory / 'medusa' / hf.WEIGHTS):
    header, _ = safetensors_file.read_header(path)
    assert {info['dtype'] for info in header.values()} == {'BF16'}
  assert json.loads((directory / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
  back = mtp.load(workdir_lib.import_weights(directory, tmp_path / 'w'))
  want = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                      nnx.to_pure_dict(nnx.state(loaded.model.trunk)))
  jax.tree.map(np.testing.assert_array_equal, want, nnx.to_pure_dict(nnx.state(back.model.trunk)))


def test_heads_with_their_own_output_layer_are_refused_on_import(exports, tmp_path):
  """mtp heads share the trunk's output layer: Medusa heads trained with their own lm_heads
  (FasterDecoding's Medusa-1) cannot be imported, and the message says why."""
  import shutil
  from safetensors import numpy as safetensors_numpy
  directory = tmp_path / 'hf'
  shutil.copytree(exports['medusa'][1], directory)
  path = directory / 'medusa' / hf.WEIGHTS
  tensors = safetensors_numpy.load_file(path)
  tensors['lm_heads.1.weight'] = tensors['lm_heads.1.weight'] + 1
  safetensors_numpy.save_file(tensors, path)
  with pytest.raises(PretrainedError, match="its medusa heads cannot be imported: medusa/: "
                     "lm_heads.1.weight differs from the base model's output layer"):
    workdir_lib.import_weights(directory, tmp_path / 'w')
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('dtype', ['int8', np.float64, 'float8_e4m3fn'])
def test_a_dtype_the_format_cannot_hold(exports, tmp_path, dtype):
  with pytest.raises(ExportError, match='the hf format holds float32, bfloat16, float16'):
    hf.write(exports['medusa'][0], tmp_path, dtype)
  assert not list(tmp_path.iterdir())


def test_values_out_of_float16_range(bpe_tokenizer, tmp_path):
  loaded = _loaded('medusa', bpe_tokenizer)
  norm = loaded.model.trunk.final_norm.scale
  norm[...] = norm[...].at[0].set(1e6)
  with pytest.raises(ExportError, match='model.norm.weight does not fit in float16'):
    hf.write(loaded, tmp_path, np.float16)
  assert not list(tmp_path.iterdir())


class NoFormatHeads(medusa.MedusaHeads):
  """A family like Medusa but without a serving format (the protocol's default hook)."""
  hf_export = heads_lib.HeadFamily.hf_export


def test_a_head_family_without_a_format(monkeypatch, tmp_path):
  monkeypatch.setitem(heads_lib.FAMILIES, 'no_format', NoFormatHeads)
  config = testing.tiny_config(**{'model.mtp_head_type': 'no_format'})
  model = mtp_model.MTPModel(mtp_model.ModelConfig.from_config(config.model), rngs=nnx.Rngs(0))
  loaded = api.LoadedModel(model=model, tokenizer=tokenizer_lib.byte_tokenizer(),
                           config=config, step=0, workdir=tmp_path)
  output = tmp_path / 'out'
  output.mkdir()
  with pytest.raises(ExportError, match="cannot carry head family 'no_format'"):
    hf.write(loaded, output, np.float32)
  assert not list(output.iterdir())
  # The export driver asks before loading the model: from the workdir's config alone.
  checkpointing.save_config(tmp_path, config)
  with pytest.raises(ExportError, match="cannot carry head family 'no_format'"):
    hf.check_options(tmp_path, np.float32)
  config.model.mtp_head_type = 'medusa'
  checkpointing.save_config(tmp_path, config)
  hf.check_options(tmp_path, np.float32)


# ------------------------------------------------------------------------------------------
# transformers and torch: the consumers.
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def oracle():
  """torch and transformers, in a process of their own (`hf_torch_check`)."""
  with mtp_testing.oracle_process('torch', 'transformers') as pool:
    yield pool


@pytest.fixture(scope='module')
def reference(exports, oracle):
  """family -> transformers' outputs on `_tokens` (`hf_torch_check.forward`)."""
  return {family: oracle.submit(hf_torch_check.forward, directory, _tokens(loaded)).result()
          for family, (loaded, directory, _) in exports.items()}


@pytest.mark.parametrize('family', list(CASES))
def test_transformers_logits_match(exports, reference, family):
  loaded = exports[family][0]
  ours, hidden = _ours(loaded, _tokens(loaded))
  theirs = reference[family]
  np.testing.assert_allclose(theirs['logits'], ours[0], atol=2e-5 * np.abs(ours[0]).max(),
                             rtol=0)
  np.testing.assert_allclose(theirs['hidden'], hidden, atol=1e-5 * np.abs(hidden).max())


@pytest.mark.parametrize('family', ['medusa', 'sequential'])
def test_greedy_generation_matches(exports, oracle, family):
  """transformers' greedy `generate` with the exported generation_config equals mtp's."""
  loaded, directory, _ = exports[family]
  prompts = ['def wrap(text, width=70', 'The quick brown']
  ours = mtp.generate(loaded, prompts, max_new_tokens=24, decoder='autoregressive')
  theirs = oracle.submit(hf_torch_check.greedy, directory,
                         [loaded.tokenizer.encode(p) for p in prompts], 24).result()
  assert theirs == [generation.tokens for generation in ours]


@pytest.mark.parametrize('family', ['medusa', 'sequential'])
def test_auto_tokenizer_reproduces_our_ids(exports, oracle, family):
  """Byte tokenizer (no template) and BPE (with a chat template), on code and prose."""
  loaded, directory, _ = exports[family]
  ours = loaded.tokenizer
  texts = _texts()
  if ours.chat_template is None:  # Special-token strings stay text, as in mtp.
    texts['literal'] = 'if token == "<eos>" or token == "<pad>":'
  ids = {name: ours.encode(text) for name, text in texts.items()}
  messages = [{'role': 'user', 'content': 'Hi there'}] if ours.chat_template else None
  theirs = oracle.submit(hf_torch_check.tokenizer, directory, texts, ids, messages).result()
  assert theirs['encoded'] == ids  # Defaults: nothing added, no BOS.
  assert theirs['decoded'] == texts
  assert theirs['special'] == (ours.bos_id, ours.eos_id, ours.pad_id)
  if messages:
    assert theirs['rendered'] == '<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n'


def _assert_logits_close(got, want):
  np.testing.assert_allclose(got, want, atol=5e-5 * np.abs(want).max(), rtol=0)


def test_medusa_heads_in_vllm_format(exports, reference, oracle):
  """vLLM's Medusa (`formats_torch_check.medusa_logits`) over the target's normed last
  states."""
  loaded, directory, _ = exports['medusa']
  config = json.loads((directory / 'medusa' / 'config.json').read_text())
  assert config['model_type'] == 'medusa' and config['architectures'] == ['MedusaModel']
  assert (config['num_heads'], config['num_hidden_layers']) == (3, 2)
  assert config['medusa_fc_bias'] and config['original_lm_head']
  assert (config['hidden_size'], config['vocab_size']) == (64, loaded.model.cfg.trunk.vocab_size)
  # vLLM renames keys holding "num" and "heads"/"layers": only Medusa's own may be there.
  assert [k for k in config if 'num' in k] == ['num_heads', 'num_hidden_layers']
  normed = reference['medusa']['normed'][0]  # [T, D], the first row
  theirs = oracle.submit(formats_torch_check.medusa_logits, directory, normed).result()
  ours, _ = _ours(loaded, _tokens(loaded))
  for i in range(config['num_heads']):
    _assert_logits_close(theirs[i], ours[1 + i, 0])


def test_sequential_modules_as_deepseek_mtp_layers(exports, reference, oracle):
  """DeepSeek-V3's MTP layers (`formats_torch_check.deepseek_mtp_logits`), fed h_0 before the
  final norm, as mtp trains them."""
  loaded, directory, _ = exports['sequential']
  depth = json.loads((directory / 'config.json').read_text())['num_nextn_predict_layers']
  tokens = _tokens(loaded)[0]
  t = tokens.shape[0]
  theirs = oracle.submit(formats_torch_check.deepseek_mtp_logits, directory, tokens,
                         reference['sequential']['hidden'][0]).result()
  ours, _ = _ours(loaded, _tokens(loaded))
  assert theirs.shape[0] == depth
  for k in range(depth):
    _assert_logits_close(theirs[k, :t - depth], ours[1 + k, 0, :t - depth])


def test_parallel_heads_layout(exports, reference, oracle):
  """parallel_heads/ (`formats_torch_check.parallel_heads_logits`):
  lm_head(norm_k(layer_k(h_0)))."""
  loaded, directory, _ = exports['parallel']
  config = json.loads((directory / 'parallel_heads' / 'config.json').read_text())
  assert config['num_heads'] == 3
  theirs = oracle.submit(formats_torch_check.parallel_heads_logits, directory,
                         reference['parallel']['hidden'][0]).result()
  ours, _ = _ours(loaded, _tokens(loaded))
  for k in range(config['num_heads']):
    _assert_logits_close(theirs[k], ours[1 + k, 0])


def test_speculative_streaming_layout(exports, oracle):
  """speculative_streaming/ (`formats_torch_check.streaming_logits`): the streams as its config's
  description states them, on transformers' own layer inputs."""
  loaded, directory, _ = exports['streaming']
  config = json.loads((directory / 'speculative_streaming' / 'config.json').read_text())
  assert config['model_type'] == 'mtp_speculative_streaming'
  tokens = _tokens(loaded)[:1]
  theirs = oracle.submit(formats_torch_check.streaming_logits, directory, tokens).result()
  ours, _ = _ours(loaded, tokens)
  for j in range(config['num_streams']):
    _assert_logits_close(theirs[:, j], ours[1 + j, 0])


@pytest.mark.parametrize('change,message', [
    ('drop_lora', 'speculative_streaming/: missing tensor '
                  'model.layers.1.self_attn.v_proj.lora_B.weight'),
    ('wrong_shape', r'stream_embeddings has shape \(3, 7\), expected \(3, 64\)'),
])
def test_a_broken_streaming_export_is_named_on_import(exports, tmp_path, change, message):
  import shutil
  from safetensors import numpy as safetensors_numpy
  directory = tmp_path / 'hf'
  shutil.copytree(exports['streaming'][1], directory)
  path = directory / 'speculative_streaming' / hf.WEIGHTS
  tensors = safetensors_numpy.load_file(path)
  if change == 'drop_lora':
    del tensors['model.layers.1.self_attn.v_proj.lora_B.weight']
  else:
    tensors['stream_embeddings'] = np.zeros((3, 7), np.float32)
  safetensors_numpy.save_file(tensors, path)
  with pytest.raises(PretrainedError, match=message):
    workdir_lib.import_weights(directory, tmp_path / 'w')
  assert not (tmp_path / 'w').exists()
