"""Row-mapped decoding: each row bit-identical to a batch of one, fillers and stops skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import row_mapped
from mtp.decode import state as state_lib
from mtp.decode import testing as decode_testing
from mtp.model import testing as model_testing

PROMPTS = [[5, 9, 11, 3], [7, 7], [1, 2, 3, 4, 5, 6, 7], [12]]


def _model():
  return model_testing.tiny_model()


def test_row_mapped_calls_equal_batch_of_one_bit_for_bit():
  model = _model()
  tokens, lengths = state_lib.pad_prompts(PROMPTS, multiple=8)

  def logits(m, tokens, lengths, next_tokens):
    b, w = tokens.shape
    cache = m.init_cache(b, 24)
    positions = jnp.broadcast_to(jnp.arange(w), (b, w))
    out, cache = m.step(tokens, positions, cache, jnp.zeros((b,), jnp.int32))
    positions = lengths[:, None] + jnp.arange(next_tokens.shape[1])[None]
    out2, _ = m.step(next_tokens, positions, cache, lengths)
    return m.logits(out.normed), m.logits(out2.normed)

  batched = jax.jit(lambda *a: logits(row_mapped.RowMapped(model), *a))
  alone = jax.jit(lambda *a: logits(model, *a))
  following = jnp.full((len(PROMPTS), 4), 6, jnp.int32)
  got = batched(tokens, lengths, following)
  for row in range(len(PROMPTS)):
    want = alone(tokens[row:row + 1], lengths[row:row + 1], following[row:row + 1])
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g[row]), np.asarray(w[0]))


def _engine(model, decoder, exact):
  return decode_testing.engine(model, decoder, max_new_tokens=6, exact=exact)


def _alone(model, decoder, tokens, lengths):
  engine = _engine(model, decoder, exact=False)
  return [engine.generate(tokens[r:r + 1], lengths[r:r + 1],
                          decode_testing.settings(engine, 1, max_new_tokens=6))
          for r in range(len(PROMPTS))]


@pytest.mark.parametrize('decoder', ['speculative', 'autoregressive'])
def test_row_mapped_decode_equals_batch_of_one_with_fillers_and_stops(decoder):
  model = state_lib.prepare(_model())
  tokens, lengths = state_lib.pad_prompts(PROMPTS, multiple=8)
  alone = _alone(model, decoder, tokens, lengths)
  engine = _engine(model, decoder, exact=True)
  active = np.array([True, True, False, True])  # Row 2 is a filler.
  state = engine.prefill(tokens, lengths, decode_testing.settings(engine, 4, max_new_tokens=6),
                         active)
  state = engine.step(state, 1)
  state = engine.evict(state, np.array([False, False, False, True]))  # Row 3 stops.
  state = engine.step(state, 10)
  last = engine.result(state)
  for row in (0, 1):
    np.testing.assert_array_equal(last.tokens[row], alone[row].tokens[0])
    np.testing.assert_array_equal(last.accepted_histogram[row],
                                  alone[row].accepted_histogram[0])
  assert last.num_steps[2] == 0  # The filler never ran a step.
  assert last.num_steps[3] == 1  # Stopped after one step.
  np.testing.assert_array_equal(last.tokens[3, :2], alone[3].tokens[0, :2])


def test_rows_joining_between_chunks_equal_batch_of_one():
  model = state_lib.prepare(_model())
  tokens, lengths = state_lib.pad_prompts(PROMPTS, multiple=8)
  alone = _alone(model, 'speculative', tokens, lengths)
  engine = _engine(model, 'speculative', exact=True)
  rows = decode_testing.settings(engine, 4, max_new_tokens=6)

  def join(state, prompts, prompt_lengths, joining):
    joining = np.asarray(joining)
    return engine.insert(state, engine.prefill(prompts, prompt_lengths, rows, joining),
                         joining)

  state = join(None, tokens, lengths, [True, False, False, False])
  state = engine.step(state, 1)
  state = join(state, tokens, lengths, [False, True, True, False])  # Rows 1, 2 join mid-way.
  state = engine.step(state, 2)
  state = engine.evict(state, np.array([False, False, True, False]))  # Row 2 leaves early.
  state = join(state, tokens, lengths, [False, False, False, True])
  for _ in range(8):
    state = engine.step(state, 1)
  last = engine.result(state)
  for row in (0, 1, 3):
    np.testing.assert_array_equal(last.tokens[row], alone[row].tokens[0])
    np.testing.assert_array_equal(last.accepted_histogram[row],
                                  alone[row].accepted_histogram[0])
  assert last.num_steps[2] == 2
  # The row that left, reused: a new prompt in slot 2 equals its own batch of one.
  state = join(state, tokens[::-1].copy(), lengths[::-1].copy(), [False, False, True, False])
  for _ in range(8):
    state = engine.step(state, 1)
  np.testing.assert_array_equal(engine.result(state).tokens[2], alone[1].tokens[0])
