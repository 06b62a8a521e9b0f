"""Tokenizers: byte-level BPE (trained with HF `tokenizers`), a plain byte tokenizer, and
pretrained models' own tokenizers.

All are Hugging Face `tokenizers` models. The project's own kinds share one id layout for special
tokens: pad=0, eos=1, bos=2. The byte tokenizer maps byte b to id b + 3 (vocab_size 259); a
trained BPE tokenizer starts from the same 256-byte alphabet and adds merges, so any text
round-trips: `decode(encode(x)) == x` (whitespace, indentation and unicode included).

A pretrained tokenizer keeps its own special ids (SmolLM2: bos=1, eos=2, pad=2), saved beside
`tokenizer.json` as `special_tokens.json`; a directory without that file uses the layout above.
A chat model's template (Jinja, as Hugging Face writes it) is saved beside them as
`chat_template.jinja`.
pad may equal eos: padding is marked by segment ids and lengths, never recognised by its id.

Special-token strings occurring in the text (for example the literal `<eos>` in source code) are
encoded as ordinary bytes, never as the special id.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import dataclasses
import functools
import json
import os

import numpy as np
import tokenizers
from etils import epath
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtp.checkpoint import paths

PAD, EOS, BOS = '<pad>', '<eos>', '<bos>'
SPECIAL_TOKENS = (PAD, EOS, BOS)  # ids 0, 1, 2
NUM_BYTES = 256
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTES  # 259
FILENAME = 'tokenizer.json'
SPECIAL_IDS_FILENAME = 'special_tokens.json'
CHAT_TEMPLATE_FILENAME = 'chat_template.jinja'


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Ids of the padding, end and beginning of sequence tokens (pad may equal eos)."""
  pad_id: int = 0
  eos_id: int = 1
  bos_id: int = 2

  @classmethod
  def from_json(cls, text: str, path: str | os.PathLike = SPECIAL_IDS_FILENAME) -> SpecialIds:
    try:
      values = json.loads(text)
      return cls(**{f.name: int(values[f.name]) for f in dataclasses.fields(cls)})
    except (ValueError, TypeError, KeyError) as e:
      raise ValueError(f'{path} must hold integer pad_id, eos_id and bos_id ({e!r}).') from e

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2) + '\n'


LEGACY_SPECIAL_IDS = SpecialIds()  # <pad>, <eos>, <bos> = 0, 1, 2


@functools.cache
def _byte_to_unicode() -> tuple[str, ...]:
  """GPT-2's printable stand-in for each byte value, as used by the ByteLevel pre-tokenizer."""
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
               *range(ord('®'), ord('ÿ') + 1)]
  chars = {}
  extra = 0
  for b in range(NUM_BYTES):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(NUM_BYTES + extra)
      extra += 1
  return tuple(chars[b] for b in range(NUM_BYTES))


def byte_characters() -> tuple[str, ...]:
  """The 256 characters byte-level BPE vocabularies spell bytes 0..255 with."""
  return _byte_to_unicode()


def byte_level_spelling(text: str) -> str:
  """`text` as byte-level BPE vocabularies spell it: each UTF-8 byte as its stand-in character."""
  chars = _byte_to_unicode()
  return ''.join(chars[b] for b in text.encode('utf-8'))


def is_byte_level_spelled(token: str) -> bool:
  """Whether every character of `token` is a byte's stand-in (so BPE can produce it)."""
  return set(token) <= _byte_alphabet()


@functools.cache
def _byte_alphabet() -> frozenset[str]:
  return frozenset(_byte_to_unicode())


def _byte_vocab() -> dict[str, int]:
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
  vocab.update({c: len(SPECIAL_TOKENS) + b for b, c in enumerate(_byte_to_unicode())})
  return vocab


def _configure(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  """Byte-level pre-tokenizer/decoder, special tokens, literal special strings kept as text."""
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)
                          for s in SPECIAL_TOKENS])
  tok.encode_special_tokens = True
  return tok


class Tokenizer:
  """A thin wrapper around a HF `tokenizers.Tokenizer` and its special ids.

  Without `special_ids`, the tokenizer must follow the project's layout (<pad>, <eos>, <bos> at
  0, 1, 2). `decode` skips the special ids and every token the HF tokenizer marks special.
  """

  def __init__(self, hf_tokenizer: tokenizers.Tokenizer, special_ids: SpecialIds | None = None,
               chat_template: str | None = None):
    self._tok = hf_tokenizer
    self._chat_template = chat_template or None
    self._tok.encode_special_tokens = True
    self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    if special_ids is None:
      for want, name in enumerate(SPECIAL_TOKENS):
        got = self._tok.token_to_id(name)
        if got != want:
          raise ValueError(f'Tokenizer must map {name!r} to id {want}, got {got}.')
      special_ids = LEGACY_SPECIAL_IDS
    for name, value in dataclasses.asdict(special_ids).items():
      if not 0 <= value < self._vocab_size:
        raise ValueError(f'{name} {value} is outside the tokenizer\'s {self._vocab_size} ids.')
    self._special_ids = special_ids
    self._kind = ('byte' if special_ids == LEGACY_SPECIAL_IDS and _is_byte_model(self._tok)
                  else 'bpe')
    marked = [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]
    self._skipped = np.unique(np.asarray(
        [*dataclasses.astuple(special_ids), *marked], np.int64))

  @property
  def hf_tokenizer(self) -> tokenizers.Tokenizer:
    return self._tok

  @property
  def kind(self) -> str:
    """'byte' or 'bpe'."""
    return self._kind

  @property
  def chat_template(self) -> str | None:
    """The model's chat template (Jinja source, Hugging Face conventions), if it has one."""
    return self._chat_template

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def special_ids(self) -> SpecialIds:
    return self._special_ids

  @property
  def pad_id(self) -> int:
    return self._special_ids.pad_id

  @property
  def eos_id(self) -> int:
    return self._special_ids.eos_id

  @property
  def bos_id(self) -> int:
    return self._special_ids.bos_id

  def encode(self, text: str, *, special: bool = False) -> list[int]:
    """Ids of `text`, without bos/eos added.

    Args:
      text: any text.
      special: False (data, prompts): special-token strings in the text are ordinary text.
        True (a rendered chat template, whose markers such as `<|im_start|>` are meant as the
        model's special tokens): they become their ids.
    """
    if special:
      return self._special_parser.encode(text, add_special_tokens=False).ids
    if self._kind == 'byte':  # Same ids as the HF model, ~100x faster.
      return _encode_bytes(text).tolist()
    return self._tok.encode(text, add_special_tokens=False).ids

  @functools.cached_property
  def _special_parser(self) -> tokenizers.Tokenizer:
    # A second instance: flipping the shared one's flag would race with other threads' encodes.
    parser = tokenizers.Tokenizer.from_str(self._tok.to_str())
    parser.encode_special_tokens = False
    return parser

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text (Rust threads do the work in parallel)."""
    if self._kind == 'byte':
      return [_encode_bytes(t).tolist() for t in texts]
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]

  def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Like `encode_batch`, as int32 arrays (cheaper for large corpora)."""
    if self._kind == 'byte':
      return [_encode_bytes(t) for t in texts]
    return [np.asarray(ids, np.int32) for ids in self.encode_batch(texts)]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of `ids`; special ids (pad/bos/eos and the tokenizer's own) and ids outside the
    vocabulary are skipped.

    Invalid UTF-8 (e.g. a multi-byte character cut in half) decodes to U+FFFD.
    """
    ids = np.asarray(ids, np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self._vocab_size) & ~np.isin(ids, self._skipped)]
    if self._kind == 'byte':
      data = (ids - len(SPECIAL_TOKENS)).astype(np.uint8).tobytes()
      return data.decode('utf-8', errors='replace')
    return self._tok.decode(ids.tolist(), skip_special_tokens=True)

  def save(self, directory: str | os.PathLike) -> epath.Path:
    """Writes `directory/tokenizer.json` (HF format) and returns its path.

    Special ids other than the project's layout go to `directory/special_tokens.json`, and a
    chat template to `directory/chat_template.jinja`.
    """
    directory = epath.Path(directory)  # Local, or on an object store (gs://).
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    specials = directory / SPECIAL_IDS_FILENAME
    if self._special_ids != LEGACY_SPECIAL_IDS:
      paths.write_atomically(specials, self._special_ids.to_json())
    elif specials.exists():
      specials.unlink()
    template = directory / CHAT_TEMPLATE_FILENAME
    if self._chat_template is not None:
      paths.write_atomically(template, self._chat_template)
    elif template.exists():
      template.unlink()
    paths.write_atomically(path, self.to_json())
    return path

  def to_json(self) -> str:
    """The HF `tokenizer.json` contents (also used as a cache key)."""
    return self._tok.to_str()

  @classmethod
  def load(cls, directory: str | os.PathLike) -> Tokenizer:
    """Reads `directory/tokenizer.json` (or the file itself if given a file path) and the
    `special_tokens.json` and `chat_template.jinja` beside it, if any.

    Raises:
      FileNotFoundError: there is no tokenizer file.
      ValueError: a file is corrupt or not a usable tokenizer (the message names it).
    """
    path = epath.Path(directory)
    if path.is_dir():
      path = path / FILENAME
    if not path.is_file():
      raise FileNotFoundError(f'No tokenizer file at {path}.')
    specials = path.with_name(SPECIAL_IDS_FILENAME)
    text = _read_optional(specials)
    special_ids = None if text is None else SpecialIds.from_json(text, specials)
    chat_template = _read_optional(path.with_name(CHAT_TEMPLATE_FILENAME))
    try:
      hf_tokenizer = tokenizers.Tokenizer.from_str(path.read_text(encoding='utf-8'))
    except Exception as e:  # pylint: disable=broad-except  # The Rust side raises bare Exception.
      raise ValueError(f'{path} is corrupt or not a tokenizer file ({e}).') from e
    try:
      return cls(hf_tokenizer, special_ids, chat_template)
    except ValueError as e:
      raise ValueError(f'{path}: {e}') from e

  def __repr__(self) -> str:
    return f'Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})'


def emittable(tokenizer, vocab_size: int) -> tuple[int | None, tuple[int, ...]]:
  """(vocab_limit, banned_ids) for a model with `vocab_size` output ids: decoders emit only ids
  the tokenizer decodes: not the output layer's spare ids past the tokenizer's vocabulary, nor
  the pad id (unless it doubles as EOS, as in SmolLM2). vocab_limit is None where every id
  decodes."""
  limit = min(tokenizer.vocab_size, vocab_size)
  banned = () if tokenizer.pad_id in (None, tokenizer.eos_id) else (int(tokenizer.pad_id),)
  return (None if limit == vocab_size else int(limit)), banned


def _read_optional(path: epath.Path) -> str | None:
  """The text of a file beside the tokenizer, None if there is none."""
  if not path.is_file():
    return None
  try:
    return path.read_text(encoding='utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(f'{path} is not UTF-8 text ({e}).') from e


def _encode_bytes(text: str) -> np.ndarray:
  return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32) + len(SPECIAL_TOKENS)


def _is_byte_model(tok: tokenizers.Tokenizer) -> bool:
  return (tok.get_vocab_size(with_added_tokens=True) == BYTE_VOCAB_SIZE
          and tok.get_vocab(with_added_tokens=True) == _byte_vocab())


def byte_tokenizer() -> Tokenizer:
  """pad=0, eos=1, bos=2, byte b -> b + 3: vocab_size 259."""
  model = models.BPE(vocab=_byte_vocab(), merges=[])
  return Tokenizer(_configure(tokenizers.Tokenizer(model)))


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
              max_token_length: int | None = 32) -> Tokenizer:
  """Trains a byte-level BPE tokenizer of at most `vocab_size` ids (specials and bytes included).

  `texts` may be any iterable (a generator keeps memory flat). The result can be smaller than
  `vocab_size` when the corpus has too few frequent pairs.
  """
  if vocab_size < BYTE_VOCAB_SIZE:
    raise ValueError(f'vocab_size={vocab_size} is too small for a byte-level BPE: it needs at '
                     f'least {BYTE_VOCAB_SIZE} ids ({len(SPECIAL_TOKENS)} special + '
                     f'{NUM_BYTES} bytes).')
  tok = _configure(tokenizers.Tokenizer(models.BPE()))
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=list(_byte_to_unicode()),
      max_token_length=max_token_length,
      show_progress=False,
  )
  tok.train_from_iterator(iter(texts), trainer=trainer)
  return Tokenizer(tok)
