"""Streaming: a host generator that yields text as the decode loop accepts tokens.

The compiled loop runs a chunk of steps per call (`engine.Engine.chunks`); between chunks the
host reads each row's new tokens and turns them into text (`text_updates`). Nothing happens on
the host per token or per step, only per chunk.

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


def text_updates(results: Iterator[state_lib.DecodeResult], tokenizer
                 ) -> Iterator[StreamUpdate]:
  """Turns the partial results of `engine.Engine.chunks` into each row's new text."""
  streams = None
  previous = None
  for result in results:
    counts = np.asarray(result.num_generated)
    tokens = np.asarray(result.tokens)
    if streams is None:
      streams = [TextStream(tokenizer) for _ in range(len(counts))]
      previous = np.zeros_like(counts)
    done = result.done
    new_tokens = [tokens[row, previous[row]:counts[row]] for row in range(len(counts))]
    text = []
    for row, (s, new) in enumerate(zip(streams, new_tokens)):
      piece = s.push(new) if len(new) else ''
      if done[row] and previous[row] < counts[row]:  # Finished in this chunk: release the rest.
        piece += s.flush()
      text.append(piece)
    previous = counts
    yield StreamUpdate(text=text, new_tokens=new_tokens, done=done, result=result)
