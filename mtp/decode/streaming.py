"""Streaming: a host generator that yields text as the decode loop accepts tokens.

The compiled loop runs a chunk of steps per call (`driver.generate_chunks`); between
chunks the host reads each row's new tokens and turns them into text. Nothing happens on the
host per token or per step, only per chunk.

Turning tokens into text piece by piece needs care: one character may span several tokens
(byte-level BPE splits multi-byte UTF-8 characters; the byte tokenizer always does), and a
token's text may depend on its neighbours. `TextStream` decodes a window of tokens that starts
at a known character boundary and holds back trailing U+FFFD replacement characters (possibly a
character cut in half) until more tokens or the end arrive, so the concatenated pieces equal
the decode of all tokens at once.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from mtp.decode import driver
from mtp.decode import state as state_lib

_REPLACEMENT = '\ufffd'


class TextStream:
  """Incremental detokenizer of one sequence: `push` tokens, get the new text.

  Invariant: the pieces returned by `push` and `flush`, concatenated, equal
  `tokenizer.decode(all tokens pushed)`.
  """

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self._tokens: list[int] = []
    self._window = 0  # First token of the window; it starts on a character boundary.
    self._emitted = ''  # Text of the window already returned.

  def push(self, tokens: Sequence[int]) -> str:
    """Adds tokens; returns the text that is final now (possibly '')."""
    self._tokens.extend(int(t) for t in tokens)
    text = self._tokenizer.decode(self._tokens[self._window:])
    # A trailing replacement character may be a character whose remaining bytes are still to
    # come: hold it back. Every character before it is final.
    stable = text.rstrip(_REPLACEMENT)
    if not stable.startswith(self._emitted):
      return ''  # Not expected for byte-level tokenizers; wait for the flush to settle it.
    piece = stable[len(self._emitted):]
    if stable == text:  # The window ends on a character boundary: start a new window there.
      self._window, self._emitted = len(self._tokens), ''
    else:
      self._emitted = stable
    return piece

  def flush(self) -> str:
    """The text still held back (the sequence ended)."""
    text = self._tokenizer.decode(self._tokens[self._window:])
    if not text.startswith(self._emitted):
      raise RuntimeError('tokenizer decoding is not prefix-stable: streamed text diverged from '
                         f'the full decode ({self._emitted!r} vs {text!r})')
    piece = text[len(self._emitted):]
    self._window, self._emitted = len(self._tokens), ''
    return piece


@dataclasses.dataclass
class StreamUpdate:
  """What one chunk of the decode loop produced.

  Attributes:
    text: [B] new text per row since the previous update ('' for none).
    new_tokens: [B] new token ids per row (numpy int32 arrays, EOS included).
    done: [B] bool, rows that have finished (all their text has been yielded).
    result: the decode result so far (numpy arrays): the final one in the last update.
  """
  text: list[str]
  new_tokens: list[np.ndarray]
  done: np.ndarray
  result: state_lib.DecodeResult


def stream(model, tokenizer, prompts, prompt_lengths=None, *, max_new_tokens: int,
           decoder: str = 'speculative', steps_per_chunk: int | None = None,
           eos_id: int | None = None, **decode_kwargs) -> Iterator[StreamUpdate]:
  """Decodes right-padded prompts, yielding each row's new text after every chunk of steps.

  Args:
    model: an `MTPModel` or `state.PreparedModel`.
    tokenizer: a `Tokenizer` (anything with `decode(ids) -> str`).
    prompts: [B, P] int token ids, right-padded; prompt_lengths: [B] (None: all P).
    max_new_tokens: tokens per row at most.
    decoder: a name in `decoders.NAMES`.
    steps_per_chunk: loop steps per compiled call (None: the decoder's default). Smaller
      chunks stream more smoothly and cost one more host round trip each.
    eos_id: rows stop after it (None: no row stops early).
    **decode_kwargs: the rest of `driver.generate`'s options (pad_id, temperature, top_k,
      top_p, rng, tree, lookup, cache_capacity, ...).

  Yields:
    StreamUpdate after the prefill and after each chunk; the last one has every row done and
    the complete result. Concatenating a row's `text` over all updates gives
    `tokenizer.decode(result.tokens[row, :result.num_generated[row]])`.
  """
  return text_updates(
      driver.generate_chunks(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                             decoder=decoder, steps_per_chunk=steps_per_chunk, eos_id=eos_id,
                             **decode_kwargs),
      tokenizer, max_new_tokens=max_new_tokens, eos_id=eos_id)


def text_updates(results: Iterator[state_lib.DecodeResult], tokenizer, *, max_new_tokens: int,
                 eos_id: int | None) -> Iterator[StreamUpdate]:
  """Turns the partial results of `driver.decode_chunks` into each row's new text."""
  streams = None
  previous = None
  for result in results:
    counts = np.asarray(result.num_generated)
    tokens = np.asarray(result.tokens)
    if streams is None:
      streams = [TextStream(tokenizer) for _ in range(len(counts))]
      previous = np.zeros_like(counts)
    done = _finished(tokens, counts, max_new_tokens, eos_id)
    new_tokens = [tokens[row, previous[row]:counts[row]] for row in range(len(counts))]
    text = []
    for row, (s, new) in enumerate(zip(streams, new_tokens)):
      piece = s.push(new) if len(new) else ''
      if done[row] and previous[row] < counts[row]:  # Finished in this chunk: release the rest.
        piece += s.flush()
      text.append(piece)
    previous = counts
    yield StreamUpdate(text=text, new_tokens=new_tokens, done=done, result=result)


def _finished(tokens: np.ndarray, counts: np.ndarray, max_new_tokens: int,
              eos_id: int | None) -> np.ndarray:
  """[B] rows that stopped: max_new_tokens reached, or the last token is EOS."""
  done = counts >= max_new_tokens
  if eos_id is not None:
    last = tokens[np.arange(len(counts)), np.maximum(counts - 1, 0)]
    done |= (counts > 0) & (last == eos_id)
  return done
