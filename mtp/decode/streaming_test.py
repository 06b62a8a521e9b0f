"""Streaming: the pieces add up to the full decode, and to the non-streamed completion."""

import numpy as np
import pytest

from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import state as state_lib
from mtp.decode import streaming
from mtp.decode import testing as decode_testing
from mtp.model import testing

# Multi-byte characters (2, 3 and 4 bytes) that byte-level BPE may split across tokens.
TEXTS = ['def f(x):\n    return x  # café, naïve\n', 'π ≈ 3.14159; 日本語のテキスト 🙂🚀\n',
         'for i in range(10):\n    print(i, "ünïcödé")\n'] * 20


@pytest.fixture(scope='module')
def bpe():
  return tokenizer_lib.train_bpe(TEXTS, vocab_size=400)


def _stream_pieces(tokenizer, tokens, cuts):
  s = streaming.TextStream(tokenizer)
  pieces = [s.push(tokens[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
  return pieces + [s.flush()]


@pytest.mark.parametrize('kind', ['byte', 'bpe'])
def test_pieces_concatenate_to_the_full_decode(kind, bpe):
  tokenizer = bpe if kind == 'bpe' else tokenizer_lib.byte_tokenizer()
  rng = np.random.default_rng(0)
  text_tokens = tokenizer.encode(''.join(TEXTS[:3]))
  for trial in range(40):
    if trial % 2:  # Random ids: invalid UTF-8, special tokens, ids cut anywhere.
      tokens = rng.integers(0, tokenizer.vocab_size, 60).tolist()
    else:
      tokens = text_tokens
    cuts = sorted({0, len(tokens), *rng.integers(0, len(tokens), trial % 9).tolist()})
    pieces = _stream_pieces(tokenizer, tokens, cuts)
    assert ''.join(pieces) == tokenizer.decode(tokens)


def test_a_split_character_is_held_back_until_complete():
  tokenizer = tokenizer_lib.byte_tokenizer()
  tokens = tokenizer.encode('a€b')  # '€' is 3 bytes.
  s = streaming.TextStream(tokenizer)
  assert s.push(tokens[:2]) == 'a'
  assert s.push(tokens[2:3]) == ''
  assert s.push(tokens[3:]) == '€b'
  assert s.flush() == ''


@pytest.fixture(scope='module')
def model():
  # Vocabulary 264 covers the byte tokenizer's 259 ids; random weights emit invalid UTF-8 too.
  return testing.tiny_model(0, vocab_size=264)


@pytest.mark.parametrize('decoder', ['speculative', 'autoregressive'])
def test_streamed_text_equals_the_completion(model, decoder):
  tokenizer = tokenizer_lib.byte_tokenizer()
  prompts = ['def add(a, b):\n', 'x = "é', 'import']
  tokens, lengths = state_lib.pad_prompts([tokenizer.encode(p) for p in prompts])
  # An EOS id the random model emits early in some rows: ragged stopping.
  full = decode_testing.decode(model, tokens, lengths, decoder=decoder, max_new_tokens=24)
  eos = int(full.tokens[1, 5])
  expected = decode_testing.decode(model, tokens, lengths, decoder=decoder, max_new_tokens=24,
                                   eos_id=eos, pad_id=tokenizer.pad_id)
  engine = decode_testing.engine(model, decoder, max_new_tokens=24)
  chunks = engine.chunks(tokens, lengths, decode_testing.settings(
      engine, len(prompts), max_new_tokens=24, eos_id=eos), steps_per_chunk=2,
                         pad_id=tokenizer.pad_id)
  updates = list(streaming.text_updates(chunks, tokenizer))
  assert len(updates) > 2 and updates[-1].done.all()
  final = updates[-1].result
  np.testing.assert_array_equal(final.tokens, expected.tokens)
  for row in range(len(prompts)):
    n = int(expected.num_generated[row])
    streamed = ''.join(u.text[row] for u in updates)
    assert streamed == tokenizer.decode(np.asarray(expected.tokens[row, :n]))
    np.testing.assert_array_equal(np.concatenate([u.new_tokens[row] for u in updates]),
                                  expected.tokens[row, :n])
    # A row is done from the update in which it finished on.
    first_done = next(i for i, u in enumerate(updates) if u.done[row])
    assert all(u.done[row] for u in updates[first_done:])
    assert all(len(u.new_tokens[row]) == 0 for u in updates[first_done + 1:])
