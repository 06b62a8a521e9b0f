"""Tests for mtp.pretrained.llama: the rotary row order and the checks."""

import dataclasses

import numpy as np
import pytest

from mtp.pretrained import llama
from mtp.pretrained import testing


def test_unpermute_follows_llama_cpp_row_order():
  # llama.cpp stores, within each head, row 2j + c for the Hugging Face row c * head_dim/2 + j.
  heads, head_dim, cols = 3, 8, 5
  stored = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
  expected = np.empty_like(stored)
  for h in range(heads):
    for j in range(head_dim // 2):
      for c in range(2):
        expected[h * head_dim + c * head_dim // 2 + j] = stored[h * head_dim + 2 * j + c]
  np.testing.assert_array_equal(llama.unpermute_rotary_rows(stored, heads), expected)
  np.testing.assert_array_equal(llama.permute_rotary_rows(expected, heads), stored)


def _checkpoint(**changes):
  tensors = testing.random_tensors()
  tensors.update(changes.pop('tensors', {}))
  for name in changes.pop('drop', ()):
    del tensors[name]
  return llama.Checkpoint(shape=changes.pop('shape', testing.SHAPE), tensors=tensors,
                          tokenizer=testing.tokenizer(), source={})


def test_check_accepts_and_maps_every_tensor():
  checkpoint = _checkpoint()
  llama.check(checkpoint, 'src')
  params = llama.to_params(checkpoint)
  block = params['trunk']['blocks'][1]
  np.testing.assert_array_equal(block['attn']['q_proj']['kernel'],
                                checkpoint.tensors['model.layers.1.self_attn.q_proj.weight'].T)
  np.testing.assert_array_equal(block['mlp']['down']['kernel'],
                                checkpoint.tensors['model.layers.1.mlp.down_proj.weight'].T)
  assert 'output' not in params['trunk']  # tied


@pytest.mark.parametrize('change, message', [
    (dict(drop=['model.layers.1.mlp.up_proj.weight']),
     'missing tensor model.layers.1.mlp.up_proj.weight'),
    (dict(tensors={'model.layers.0.mlp.up_proj.weight': np.zeros((96, 60), np.float32)}),
     r'model.layers.0.mlp.up_proj.weight has shape \[96, 60\], expected \[96, 64\]'),
    (dict(tensors={'model.layers.0.self_attn.q_proj.bias': np.zeros(64, np.float32)}),
     'unexpected tensor model.layers.0.self_attn.q_proj.bias'),
    (dict(shape=dataclasses.replace(testing.SHAPE, vocab_size=200),
          tensors={'model.embed_tokens.weight': np.zeros((200, 64), np.float32)}),
     'the tokenizer has 277 ids but the embedding has only 200 rows'),
    (dict(shape=dataclasses.replace(testing.SHAPE, num_kv_heads=3)), 'not a multiple'),
    (dict(shape=dataclasses.replace(testing.SHAPE, tie_embeddings=False)),
     'missing tensor lm_head.weight'),
])
def test_check_names_the_problem(change, message):
  with pytest.raises(llama.PretrainedError, match=message):
    llama.check(_checkpoint(**change), 'src')


def test_untied_output_is_transposed():
  shape = dataclasses.replace(testing.SHAPE, tie_embeddings=False)
  checkpoint = _checkpoint(shape=shape, tensors=testing.random_tensors(shape, seed=1))
  llama.check(checkpoint, 'src')
  np.testing.assert_array_equal(llama.to_params(checkpoint)['trunk']['output'],
                                checkpoint.tensors['lm_head.weight'].T)


@pytest.mark.parametrize('tied', [True, False])
def test_from_params_inverts_to_params(tied):
  shape = dataclasses.replace(testing.SHAPE, tie_embeddings=tied)
  checkpoint = _checkpoint(shape=shape)
  if not tied:
    checkpoint.tensors[llama.LM_HEAD] = np.ones((shape.vocab_size, shape.embed_dim), np.float32)
  back = llama.from_params(llama.to_params(checkpoint), tied)
  assert set(back) == set(llama.expected_shapes(shape))
  for name, values in back.items():
    np.testing.assert_array_equal(values, checkpoint.tensors[name], err_msg=name)
