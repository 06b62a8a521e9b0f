"""Tests for mtp.pretrained.gguf_tokenizer on a small byte-level vocabulary."""

import pytest

from mtp.data import tokenizer as tokenizer_lib
from mtp.pretrained import gguf_tokenizer
from mtp.pretrained import testing
from mtp.pretrained.llama import PretrainedError

TEXTS = [
    'def the(x):\n        return x  # tab\there\n',
    'unicode: héllo wörld, 日本語, emoji 🙂, combining e\u0301',
    'digits 12345, 3.14159 and  42 after two spaces\n    7',
    'control strings as text: <|endoftext|> <|im_start|>',
    '',
]


@pytest.fixture(scope='module')
def tok():
  return testing.tokenizer()


def test_ids_merges_and_specials(tok):
  assert tok.vocab_size == len(testing.vocabulary()[0])
  assert tok.special_ids == testing.SPECIAL_IDS
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (2, 2, 1)
  pieces = [tok.hf_tokenizer.id_to_token(i) for i in tok.encode('def the  x')]
  assert pieces == ['def', 'Ġthe', 'Ġ', 'Ġ', 'x']


@pytest.mark.parametrize('text', TEXTS)
def test_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(i >= len(testing.CONTROL_TOKENS) for i in ids)  # control strings stay text
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, 0, *ids, tok.eos_id]) == text  # every control id is skipped


def test_digits_are_split_one_by_one_first(tok):
  # SmolLM2's own tokenizer (and llama.cpp's 'smollm') splits digits before GPT-2's regex: the
  # whitespace before a digit is then a token of its own ('ĠĠ'), not a space glued to the digit.
  pieces = [tok.hf_tokenizer.id_to_token(i) for i in tok.encode('=  12')]
  assert pieces == ['=', 'ĠĠ', '1', '2']


def test_saved_tokenizer_keeps_special_ids(tok, tmp_path):
  tok.save(tmp_path)
  assert (tmp_path / tokenizer_lib.SPECIAL_IDS_FILENAME).exists()
  loaded = tokenizer_lib.Tokenizer.load(tmp_path)
  assert loaded.special_ids == tok.special_ids
  for text in TEXTS:
    assert loaded.encode(text) == tok.encode(text)


def test_unsupported_pre_tokenizer():
  tokens, merges, types = testing.vocabulary()
  with pytest.raises(PretrainedError, match="pre-tokenizer 'qwen2' is not supported"):
    gguf_tokenizer.build(tokens, merges, types, 'qwen2', testing.SPECIAL_IDS)


def test_bad_merge_and_special_id():
  tokens, merges, types = testing.vocabulary()
  with pytest.raises(PretrainedError, match='do not form a BPE model'):
    gguf_tokenizer.build(tokens, merges + ['q zz'], types, 'gpt2', testing.SPECIAL_IDS)
  with pytest.raises(PretrainedError, match='eos_id 999 is outside'):
    gguf_tokenizer.build(tokens, merges, types, 'gpt2',
                         tokenizer_lib.SpecialIds(pad_id=0, eos_id=999, bos_id=0))
