"""A GGUF file's tokenizer, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

GGUF stores the vocabulary, merges and token kinds as metadata. Byte-level BPE (`gpt2`, used by
SmolLM2, Llama 3, StarCoder ...) is supported: a BPE model over the byte-level spelling, a
pre-tokenizer chosen by `tokenizer.ggml.pre`, a ByteLevel decoder, and the control tokens
(token type 3) as special tokens. A chat template (`tokenizer.chat_template`) is kept.

`tokenizer.ggml.pre` names how text is split before the merges. For SmolLM2 and StarCoder
('smollm', 'starcoder') digits are split one by one and then GPT-2's regex applies, as in those
models' own tokenizer.json and in llama.cpp. The vocabulary has no multi-digit tokens, so the
split only shows where whitespace precedes a digit: "x =  1" ends in ['ĠĠ', '1'] here and in the
original tokenizer, ['Ġ', 'Ġ', '1'] with GPT-2's regex alone.
"""

from __future__ import annotations

import pathlib

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from mtp.data import tokenizer as tokenizer_lib
from mtp.pretrained.llama import PretrainedError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split():
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split():
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer, BPE ignore_merges). Llama 3's tokenizer.json takes a
# pre-token that is itself in the vocabulary whole (ignore_merges).
PRE_TOKENIZERS = {
    'default': (_gpt2_split, False),
    'gpt2': (_gpt2_split, False),
    'smollm': (_digits_then_gpt2, False),
    'starcoder': (_digits_then_gpt2, False),
    'refact': (_digits_then_gpt2, False),
    'codeshell': (_digits_then_gpt2, False),
    'llama-bpe': (_llama3_split, True),
    'llama3': (_llama3_split, True),
    'llama-v3': (_llama3_split, True),
}


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def build(tokens: list[str], merges: list[str], token_types: list[int], pre: str,
          special_ids: tokenizer_lib.SpecialIds, source: str = 'GGUF',
          chat_template: str | None = None) -> tokenizer_lib.Tokenizer:
  """A byte-level BPE tokenizer from GGUF-style vocabulary data.

  Args:
    tokens: the vocabulary; id i is tokens[i].
    merges: 'left right' pairs, highest priority first.
    token_types: llama.cpp's type of each token (1 normal, 3 control, 4 user-defined, ...).
    pre: the `tokenizer.ggml.pre` name (see PRE_TOKENIZERS).
    special_ids: pad/eos/bos.
    source: named in errors.
    chat_template: the model's chat template (Jinja), if it has one.
  """
  if pre not in PRE_TOKENIZERS:
    raise PretrainedError(f'{source}: pre-tokenizer {pre!r} is not supported; supported: '
                          f'{", ".join(sorted(PRE_TOKENIZERS))}.')
  if token_types and len(token_types) != len(tokens):
    raise PretrainedError(f'{source}: {len(token_types)} token types for {len(tokens)} tokens.')
  # A token written outside the byte alphabet (some converters store added tokens as plain
  # text) is respelled so that it stays reachable.
  vocab = {}
  for i, token in enumerate(tokens):
    spelled = token if tokenizer_lib.is_byte_level_spelled(token) else (
        tokenizer_lib.byte_level_spelling(token))
    vocab.setdefault(spelled, i)
  pairs = []
  for merge in merges:
    parts = merge.split(' ')
    if len(parts) != 2:
      raise PretrainedError(f'{source}: merge {merge!r} is not two tokens separated by a space.')
    pairs.append((parts[0], parts[1]))
  make_pre, ignore_merges = PRE_TOKENIZERS[pre]
  try:
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
  except Exception as e:  # A merge naming an unknown token.
    raise PretrainedError(f'{source}: the vocabulary and merges do not form a BPE model ({e}).'
                          ) from e
  tok = tokenizers.Tokenizer(model)
  tok.pre_tokenizer = make_pre()
  tok.decoder = decoders.ByteLevel()
  types = token_types or [1] * len(tokens)
  # Tokens already in the vocabulary keep their ids when added.
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types)
                          if kind == CONTROL and tokenizer_lib.is_byte_level_spelled(t)])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])
  if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise PretrainedError(f'{source}: the tokenizer has {tok.get_vocab_size()} ids, not the '
                          f'{len(tokens)} tokens listed (duplicate tokens?).')
  try:
    return tokenizer_lib.Tokenizer(tok, special_ids, chat_template)
  except ValueError as e:
    raise PretrainedError(f'{source}: {e}') from e


def from_gguf(reader, path: pathlib.Path) -> tokenizer_lib.Tokenizer:
  """The tokenizer described by a `gguf.GGUFReader`'s metadata."""
  kind = _field(reader, 'tokenizer.ggml.model')
  if kind != 'gpt2':
    raise PretrainedError(f'{path}: tokenizer model {kind!r} is not supported; only byte-level '
                          "BPE ('gpt2') can be imported.")
  tokens = _field(reader, 'tokenizer.ggml.tokens')
  merges = _field(reader, 'tokenizer.ggml.merges')
  if not tokens or merges is None:
    raise PretrainedError(f'{path}: the tokenizer metadata lacks tokens or merges.')
  eos = _field(reader, 'tokenizer.ggml.eos_token_id')
  if eos is None:
    raise PretrainedError(f'{path}: metadata tokenizer.ggml.eos_token_id is missing.')
  special_ids = tokenizer_lib.SpecialIds(
      pad_id=int(_field(reader, 'tokenizer.ggml.padding_token_id', eos)), eos_id=int(eos),
      bos_id=int(_field(reader, 'tokenizer.ggml.bos_token_id', eos)))
  token_types = [int(t) for t in _field(reader, 'tokenizer.ggml.token_type', [])]
  template = _field(reader, 'tokenizer.chat_template')
  if template is not None and not isinstance(template, str):
    raise PretrainedError(f'{path}: metadata tokenizer.chat_template is not a string.')
  return build(list(tokens), list(merges), token_types,
               _field(reader, 'tokenizer.ggml.pre', 'default'), special_ids, str(path),
               chat_template=template)
