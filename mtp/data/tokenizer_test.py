"""Tests for mtp.data.tokenizer."""

import json
import re

import numpy as np
import pytest

from mtp.data import corpora
from mtp.data import tokenizer as tokenizer_lib

TRICKY = [
    '',
    'def f(x):\n\treturn x  # tab\n',
    '    indented\n        deeper\n\n\n   trailing   \n',
    'windows\r\nline\r\nendings',
    'unicode: héllo wörld, 日本語, emoji 🙂, combining e\u0301',
    'specials as text: <pad> <eos> <bos> <|endoftext|>',
    '\x00\x01 control \x7f chars \u2028',
]


@pytest.fixture(scope='module')
def bpe() -> tokenizer_lib.Tokenizer:
  texts = [corpora.read_text(p) for p in corpora.stdlib_files()[:40]]
  return tokenizer_lib.train_bpe(iter(texts), vocab_size=600)


def test_byte_ids_layout():
  tok = tokenizer_lib.byte_tokenizer()
  assert (tok.kind, tok.vocab_size) == ('byte', 259)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  text = 'Aé\n'
  assert tok.encode(text) == [b + 3 for b in text.encode('utf-8')]
  # The fast path agrees with the HF model that is saved to disk.
  for t in TRICKY:
    assert tok.encode(t) == tok.hf_tokenizer.encode(t, add_special_tokens=False).ids


@pytest.mark.parametrize('text', TRICKY)
def test_byte_round_trip(text):
  tok = tokenizer_lib.byte_tokenizer()
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode_batch([text, text]) == [tok.encode(text)] * 2


def test_decode_skips_special_and_out_of_range_ids(bpe):
  for tok in (tokenizer_lib.byte_tokenizer(), bpe):
    ids = [tok.bos_id] + tok.encode('hi') + [tok.eos_id, tok.pad_id, tok.vocab_size + 3]
    assert tok.decode(ids) == 'hi'
    assert tok.decode(np.array(ids, np.int32)) == 'hi'


def test_bpe_special_ids_and_size(bpe):
  assert bpe.kind == 'bpe'
  assert 259 < bpe.vocab_size <= 600
  assert (bpe.pad_id, bpe.eos_id, bpe.bos_id) == (0, 1, 2)
  assert [bpe.hf_tokenizer.id_to_token(i) for i in range(3)] == ['<pad>', '<eos>', '<bos>']


@pytest.mark.parametrize('text', TRICKY)
def test_bpe_round_trip(bpe, text):
  ids = bpe.encode(text)
  assert all(3 <= i < bpe.vocab_size for i in ids)  # special strings are plain text
  assert bpe.decode(ids) == text
  assert bpe.decode([bpe.bos_id] + ids + [bpe.eos_id, bpe.pad_id]) == text


def test_bpe_round_trip_unseen_code_and_compresses(bpe):
  texts = [corpora.read_text(p) for p in corpora.heldout_files()[:5]]
  batch = bpe.encode_batch(texts)
  for text, ids in zip(texts, batch):
    assert ids == bpe.encode(text)
    assert bpe.decode(ids) == text
  assert sum(map(len, batch)) < 0.6 * sum(len(t.encode()) for t in texts)
  arrays = bpe.encode_arrays(texts)
  assert [a.tolist() for a in arrays] == batch and arrays[0].dtype == np.int32


@pytest.mark.parametrize('make', ['byte', 'bpe'])
def test_save_load(tmp_path, bpe, make):
  tok = bpe if make == 'bpe' else tokenizer_lib.byte_tokenizer()
  path = tok.save(tmp_path / 'tk')
  assert path.name == 'tokenizer.json'
  assert json.loads(path.read_text())['model']['type'] == 'BPE'  # HF format
  loaded = tokenizer_lib.Tokenizer.load(tmp_path / 'tk')
  assert (loaded.kind, loaded.vocab_size) == (tok.kind, tok.vocab_size)
  for text in TRICKY:
    assert loaded.encode(text) == tok.encode(text)
  assert loaded.to_json() == tok.to_json()


def test_load_missing(tmp_path):
  with pytest.raises(FileNotFoundError):
    tokenizer_lib.Tokenizer.load(tmp_path)


@pytest.mark.parametrize('damage', ['truncated', 'garbage', 'not_utf8', 'empty_object',
                                    'no_special_tokens', 'bad_special_ids_bytes'])
def test_a_corrupt_tokenizer_file_is_named(tmp_path, bpe, damage):
  import tokenizers
  path = bpe.save(tmp_path)
  text = path.read_text()
  named = path
  if damage == 'truncated':  # A copy cut short.
    path.write_text(text[:len(text) // 2])
  elif damage == 'garbage':
    path.write_text('not json')
  elif damage == 'not_utf8':
    path.write_bytes(b'\xff\xfe' + text.encode())
  elif damage == 'empty_object':
    path.write_text('{}')
  elif damage == 'no_special_tokens':  # Valid, but not a tokenizer of this project's layout.
    path.write_text(tokenizers.Tokenizer(tokenizers.models.BPE()).to_str())
  else:
    named = tmp_path / 'special_tokens.json'
    named.write_bytes(b'\xff{"pad_id": 0}')
  with pytest.raises(ValueError, match=re.escape(str(named))):
    tokenizer_lib.Tokenizer.load(tmp_path)


def test_vocab_too_small():
  with pytest.raises(ValueError, match='vocab_size=100 is too small'):
    tokenizer_lib.train_bpe(['abc'], 100)


def test_configurable_special_ids_are_saved_beside_the_tokenizer(tmp_path, bpe):
  import tokenizers
  ids = tokenizer_lib.SpecialIds(pad_id=1, eos_id=1, bos_id=2)  # pad == eos, as SmolLM2
  tok = tokenizer_lib.Tokenizer(tokenizers.Tokenizer.from_str(bpe.to_json()), ids)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (1, 1, 2) and tok.special_ids == ids
  tok.save(tmp_path)
  assert json.loads((tmp_path / 'special_tokens.json').read_text()) == {
      'pad_id': 1, 'eos_id': 1, 'bos_id': 2}
  loaded = tokenizer_lib.Tokenizer.load(tmp_path / 'tokenizer.json')
  assert loaded.special_ids == ids
  assert loaded.decode([2, *tok.encode('hi'), 1, 0]) == 'hi'  # <pad> is still marked special
  # A directory without special_tokens.json keeps the project's layout (existing workdirs).
  bpe.save(tmp_path)
  assert not (tmp_path / 'special_tokens.json').exists()
  assert tokenizer_lib.Tokenizer.load(tmp_path).special_ids == tokenizer_lib.LEGACY_SPECIAL_IDS


def test_bad_special_ids(tmp_path, bpe):
  import tokenizers
  with pytest.raises(ValueError, match='eos_id 600 is outside'):
    tokenizer_lib.Tokenizer(tokenizers.Tokenizer.from_str(bpe.to_json()),
                            tokenizer_lib.SpecialIds(eos_id=600))
  bpe.save(tmp_path)
  (tmp_path / 'special_tokens.json').write_text('{"pad_id": 0}')
  with pytest.raises(ValueError, match='special_tokens.json must hold integer'):
    tokenizer_lib.Tokenizer.load(tmp_path)


def test_a_chat_template_is_saved_beside_the_tokenizer(tmp_path, bpe):
  import tokenizers
  template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
  tok = tokenizer_lib.Tokenizer(tokenizers.Tokenizer.from_str(bpe.to_json()),
                                chat_template=template)
  tok.save(tmp_path)
  assert (tmp_path / 'chat_template.jinja').read_text() == template
  assert tokenizer_lib.Tokenizer.load(tmp_path).chat_template == template
  bpe.save(tmp_path)  # Saving a tokenizer without one removes a stale template.
  assert not (tmp_path / 'chat_template.jinja').exists()
  assert tokenizer_lib.Tokenizer.load(tmp_path).chat_template is None


def test_special_token_strings_are_text_unless_asked(bpe):
  text = 'a<eos>b'
  plain = bpe.encode(text)
  assert bpe.eos_id not in plain and bpe.decode(plain) == text
  parsed = bpe.encode(text, special=True)
  assert parsed == bpe.encode('a') + [bpe.eos_id] + bpe.encode('b')
  assert bpe.encode(text) == plain  # The shared tokenizer is untouched.
  byte = tokenizer_lib.byte_tokenizer()
  assert byte.encode('<bos>x', special=True) == [byte.bos_id] + byte.encode('x')


def test_the_emittable_ids_rule():
  """Decoders emit only ids the tokenizer decodes (`emittable`)."""
  tok = tokenizer_lib.byte_tokenizer()
  limit, banned = tokenizer_lib.emittable(tok, 264)
  assert limit == tok.vocab_size and banned == (tok.pad_id,)
  assert tokenizer_lib.emittable(tok, tok.vocab_size)[0] is None  # Every id decodes.
