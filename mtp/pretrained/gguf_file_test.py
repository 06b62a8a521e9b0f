"""Tests for mtp.pretrained.gguf_file on tiny GGUF files written with gguf.GGUFWriter."""

import dataclasses

import numpy as np
import pytest

from mtp.pretrained import gguf_file
from mtp.pretrained import llama
from mtp.pretrained import testing
from mtp.pretrained.llama import PretrainedError

# Every tensor type the importer must read, spread over the tiny model's tensors.
TYPES = {
    'model.embed_tokens.weight': 'Q8_0',
    'model.layers.0.self_attn.q_proj.weight': 'Q4_0',
    'model.layers.0.self_attn.k_proj.weight': 'Q4_1',
    'model.layers.0.self_attn.v_proj.weight': 'F16',
    'model.layers.0.self_attn.o_proj.weight': 'BF16',
    'model.layers.0.mlp.gate_proj.weight': 'Q8_0',
    'model.layers.0.mlp.up_proj.weight': 'Q4_1',
    'model.layers.0.mlp.down_proj.weight': 'Q4_0',
    'model.layers.1.self_attn.q_proj.weight': 'Q4_1',
    'model.layers.1.self_attn.k_proj.weight': 'Q8_0',
    'model.layers.1.self_attn.v_proj.weight': 'Q4_0',
    'model.layers.1.mlp.down_proj.weight': 'F16',
}


def unpermute_by_index(stored: np.ndarray, heads: int) -> np.ndarray:
  """Hugging Face rows from llama.cpp's: row c * half + j of a head is stored at 2j + c."""
  head_dim = stored.shape[0] // heads
  half = head_dim // 2
  order = [h * head_dim + 2 * j + c for h in range(heads) for c in range(2) for j in range(half)]
  return stored[order]


def test_reads_every_type_and_undoes_the_rotary_permutation(tmp_path):
  path = tmp_path / 'tiny.gguf'
  stored = testing.write_gguf(path, testing.random_tensors(), types=TYPES)
  checkpoint = gguf_file.read(path)
  assert np.isclose(checkpoint.shape.norm_eps, 1e-5)  # Stored as float32.
  assert dataclasses.replace(checkpoint.shape, norm_eps=1e-5) == testing.SHAPE
  names = gguf_file.gguf_names(2)
  for hf, values in checkpoint.tensors.items():
    expected = stored[names[hf]]
    if hf.endswith(('q_proj.weight', 'k_proj.weight')):
      heads = 4 if 'q_proj' in hf else 2
      expected = unpermute_by_index(expected, heads)
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, expected, err_msg=hf)
  # Quantised tensors differ from the originals only by quantisation error.
  original = testing.random_tensors()
  for hf in ('model.layers.0.self_attn.q_proj.weight', 'model.layers.1.self_attn.k_proj.weight'):
    scale = np.abs(original[hf]).max()
    assert np.abs(checkpoint.tensors[hf] - original[hf]).max() < 0.2 * scale
  assert checkpoint.tokenizer.special_ids == testing.SPECIAL_IDS
  assert checkpoint.source['format'] == 'gguf'


def _read_error(tmp_path, match, **kwargs):
  path = tmp_path / 'bad.gguf'
  testing.write_gguf(path, kwargs.pop('tensors', None) or testing.random_tensors(), **kwargs)
  with pytest.raises(PretrainedError, match=match):
    gguf_file.read(path)
  return path


def test_unsupported_architecture(tmp_path):
  _read_error(tmp_path, "architecture 'qwen2' is not supported", architecture='qwen2')


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
  _read_error(tmp_path, 'blk.1.ffn_up.weight is stored as I8, which the gguf package cannot',
              types={'model.layers.1.mlp.up_proj.weight': 'I8'})


def test_missing_tensor(tmp_path):
  _read_error(tmp_path, 'missing tensor blk.1.attn_v.weight',
              omit=('model.layers.1.self_attn.v_proj.weight',))


def test_wrong_shape(tmp_path):
  tensors = testing.random_tensors()
  tensors['model.layers.0.mlp.gate_proj.weight'] = np.zeros((64, 64), np.float32)
  _read_error(tmp_path, r'blk.0.ffn_gate.weight has shape \[64, 64\], expected \[96, 64\]',
              tensors=tensors)


def test_tokenizer_larger_than_embedding(tmp_path):
  _read_error(tmp_path, 'the tokenizer has 300 ids but the embedding has only 288 rows',
              num_tokens=300)


def test_rope_scaling_and_tokenizer_model_refused(tmp_path):
  _read_error(tmp_path, "rope scaling 'linear' is not supported",
              metadata={'rope.scaling.type': 'linear'})
  _read_error(tmp_path, "tokenizer model 'llama' is not supported", tokenizer_model='llama')


@pytest.mark.parametrize('keep', [0.3, 0.999])
def test_truncated_file_is_named(tmp_path, keep):
  path = tmp_path / 'tiny.gguf'
  testing.write_gguf(path, testing.random_tensors())
  data = path.read_bytes()
  path.write_bytes(data[:int(len(data) * keep)])
  with pytest.raises(PretrainedError, match=f'{path}.*truncated'):
    gguf_file.read(path)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / 'x.gguf'
  path.write_bytes(b'not a gguf file at all' * 10)
  with pytest.raises(PretrainedError, match=str(path)):
    gguf_file.read(path)
  with pytest.raises(PretrainedError, match='does not exist'):
    gguf_file.read(tmp_path / 'missing.gguf')


def test_hf_names_cover_every_tensor():
  names = gguf_file.gguf_names(2)
  assert set(names) == set(llama.expected_shapes(testing.SHAPE)) | {llama.LM_HEAD}
  for hf, gguf_name in names.items():
    assert gguf_file.hf_name(gguf_name)[0] == hf
  assert gguf_file.hf_name('blk.0.attn_q.bias') is None


def test_chat_template_is_kept(tmp_path):
  path = tmp_path / 'chat.gguf'
  testing.write_gguf(path, testing.random_tensors(), chat_template=testing.CHAT_TEMPLATE)
  assert gguf_file.read(path).tokenizer.chat_template == testing.CHAT_TEMPLATE
  testing.write_gguf(tmp_path / 'plain.gguf', testing.random_tensors())
  assert gguf_file.read(tmp_path / 'plain.gguf').tokenizer.chat_template is None
