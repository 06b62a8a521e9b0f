"""Tests for mtp.pretrained.hf_directory and safetensors_file on tiny directories."""

import json

import ml_dtypes
import numpy as np
import pytest

from mtp.pretrained import hf_directory
from mtp.pretrained import safetensors_file
from mtp.pretrained import testing
from mtp.pretrained.llama import PretrainedError


@pytest.mark.parametrize('dtype, shards', [(np.float32, 1), (np.float16, 3),
                                           (ml_dtypes.bfloat16, 2)])
def test_reads_single_and_sharded(tmp_path, dtype, shards):
  tensors = testing.random_tensors()
  testing.write_hf_directory(tmp_path, tensors, dtype=dtype, num_shards=shards)
  checkpoint = hf_directory.read(tmp_path)
  assert checkpoint.shape == testing.SHAPE
  assert checkpoint.tokenizer.special_ids == testing.SPECIAL_IDS
  assert set(checkpoint.tensors) == set(tensors)
  for name, values in tensors.items():
    assert checkpoint.tensors[name].dtype == np.float32
    np.testing.assert_array_equal(checkpoint.tensors[name], values.astype(dtype).astype(np.float32))


def test_tied_copy_of_lm_head_is_dropped_and_untied_kept(tmp_path):
  tensors = testing.random_tensors()
  tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'].copy()
  testing.write_hf_directory(tmp_path / 'tied', tensors)
  assert 'lm_head.weight' not in hf_directory.read(tmp_path / 'tied').tensors
  testing.write_hf_directory(tmp_path / 'untied', tensors, config={'tie_word_embeddings': False})
  checkpoint = hf_directory.read(tmp_path / 'untied')
  assert not checkpoint.shape.tie_embeddings and 'lm_head.weight' in checkpoint.tensors


def test_mistral_without_sliding_window_is_a_llama(tmp_path):
  testing.write_hf_directory(tmp_path, testing.random_tensors(), config={
      'architectures': ['MistralForCausalLM'], 'model_type': 'mistral', 'sliding_window': None})
  assert hf_directory.read(tmp_path).shape == testing.SHAPE


@pytest.mark.parametrize('config, message', [
    ({'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2'},
     "architecture \\['GPT2LMHeadModel'\\] is not supported"),
    ({'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}},
     "rope scaling 'llama3' is not supported"),
    ({'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1e4}},
     "rope scaling 'yarn' is not supported"),
    ({'architectures': ['MistralForCausalLM'], 'sliding_window': 64},
     'sliding-window attention'),
    ({'attention_bias': True}, 'attention_bias=True is not supported'),
])
def test_unsupported_configs(tmp_path, config, message):
  testing.write_hf_directory(tmp_path, testing.random_tensors(), config=config)
  with pytest.raises(PretrainedError, match=message):
    hf_directory.read(tmp_path)


def test_missing_and_misshapen_tensors(tmp_path):
  testing.write_hf_directory(tmp_path / 'a', testing.random_tensors(),
                             omit=('model.norm.weight',))
  with pytest.raises(PretrainedError, match='missing tensor model.norm.weight'):
    hf_directory.read(tmp_path / 'a')
  tensors = testing.random_tensors()
  tensors['model.layers.1.self_attn.k_proj.weight'] = np.zeros((16, 64), np.float32)
  testing.write_hf_directory(tmp_path / 'b', tensors)
  with pytest.raises(PretrainedError, match=r'k_proj.weight has shape \[16, 64\], expected '
                                            r'\[32, 64\]'):
    hf_directory.read(tmp_path / 'b')


def test_truncated_and_missing_files(tmp_path):
  testing.write_hf_directory(tmp_path, testing.random_tensors(), num_shards=2)
  shard = tmp_path / 'model-00002-of-00002.safetensors'
  shard.write_bytes(shard.read_bytes()[:-100])
  with pytest.raises(PretrainedError, match=f'{shard} is truncated'):
    hf_directory.read(tmp_path)
  shard.unlink()
  with pytest.raises(PretrainedError, match=f'{shard} .*does not exist'):
    hf_directory.read(tmp_path)
  (tmp_path / 'model.safetensors.index.json').unlink()
  with pytest.raises(PretrainedError, match='holds neither model.safetensors'):
    hf_directory.read(tmp_path)


def test_tokenizer_and_eos_are_required(tmp_path):
  testing.write_hf_directory(tmp_path, testing.random_tensors())
  for name in ('generation_config.json',):
    (tmp_path / name).unlink()
  config = json.loads((tmp_path / 'config.json').read_text())
  del config['eos_token_id']
  (tmp_path / 'config.json').write_text(json.dumps(config))
  with pytest.raises(PretrainedError, match='no eos token id'):
    hf_directory.read(tmp_path)
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|im_end|>'}))
  assert hf_directory.read(tmp_path).tokenizer.special_ids.eos_id == 2
  (tmp_path / 'tokenizer.json').unlink()
  with pytest.raises(PretrainedError, match='tokenizer.json does not exist'):
    hf_directory.read(tmp_path)


def test_safetensors_interoperates_with_the_library(tmp_path):
  st = pytest.importorskip('safetensors.numpy')
  tensors = {'a': np.arange(12, dtype=np.float32).reshape(3, 4),
             'b': np.ones(5, np.float16)}
  st.save_file(tensors, str(tmp_path / 'lib.safetensors'))
  ours = safetensors_file.read(tmp_path / 'lib.safetensors')
  for name, values in tensors.items():
    np.testing.assert_array_equal(ours[name], values)
  testing.write_safetensors(tmp_path / 'ours.safetensors', tensors)
  theirs = st.load_file(str(tmp_path / 'ours.safetensors'))
  for name, values in tensors.items():
    np.testing.assert_array_equal(theirs[name], values)


def test_safetensors_index_tensors_keep_their_dtype(tmp_path):
  """An EAGLE-3 drafter's d2t (int64) and t2d (bool) are read as written; weights as float32;
  a dtype of neither kind is named."""
  st = pytest.importorskip('safetensors.numpy')
  tensors = {'d2t': np.array([3, -1, 40], np.int64), 't2d': np.array([True, False, True]),
             'w': np.ones((2, 2), np.float16)}
  st.save_file(tensors, str(tmp_path / 'a.safetensors'))
  read = safetensors_file.read(tmp_path / 'a.safetensors')
  assert {n: v.dtype for n, v in read.items()} == {'d2t': np.int64, 't2d': np.bool_,
                                                  'w': np.float32}
  for name, values in tensors.items():
    np.testing.assert_array_equal(read[name], values)
  st.save_file({'z': np.zeros(2, np.complex64)}, str(tmp_path / 'b.safetensors'))
  with pytest.raises(PretrainedError, match='tensor z has dtype C64'):
    safetensors_file.read(tmp_path / 'b.safetensors')


def test_rope_theta_from_transformers_5_rope_parameters(tmp_path):
  testing.write_hf_directory(tmp_path, testing.random_tensors(), config={
      'rope_theta': None, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 5e5}})
  assert hf_directory.read(tmp_path).shape.rope_theta == 5e5


@pytest.mark.parametrize('where', ['tokenizer_config', 'named', 'jinja', 'none'])
def test_chat_template(tmp_path, where):
  template = testing.CHAT_TEMPLATE
  tokenizer_config = {'tokenizer_config': {'chat_template': template},
                      'named': {'chat_template': [{'name': 'tool_use', 'template': 'x'},
                                                  {'name': 'default', 'template': template}]},
                      'jinja': {'chat_template': 'overridden by the .jinja file'},
                      'none': {}}[where]
  testing.write_hf_directory(tmp_path, testing.random_tensors(), tokenizer_config=tokenizer_config)
  if where == 'jinja':
    (tmp_path / 'chat_template.jinja').write_text(template)
  got = hf_directory.read(tmp_path).tokenizer.chat_template
  assert got == (None if where == 'none' else template)


def test_multi_token_prediction_layers_are_heads_not_trunk(tmp_path):
  """DeepSeek-V3-style MTP layers after the trunk's (`num_nextn_predict_layers`) are the
  sequential family's to read (mtp/export/hf_test.py reads whole ones back); a partial one is
  named."""
  tensors = testing.random_tensors()
  extra = {f'model.layers.{testing.SHAPE.num_layers}.{name}': np.ones(4, np.float32)
           for name in ('enorm.weight', 'self_attn.q_proj.weight')}
  testing.write_hf_directory(tmp_path / 'a', {**tensors, **extra}, num_shards=2,
                             config={'num_nextn_predict_layers': 1})
  with pytest.raises(PretrainedError, match='its sequential heads cannot be imported: missing '
                     'tensor model.layers.2.eh_proj.weight'):
    hf_directory.read(tmp_path / 'a')
  testing.write_hf_directory(tmp_path / 'b', {**tensors, **extra})
  with pytest.raises(PretrainedError, match='unexpected tensor model.layers.2'):
    hf_directory.read(tmp_path / 'b')
  testing.write_hf_directory(tmp_path / 'c', tensors)
  assert hf_directory.read(tmp_path / 'c').heads is None
