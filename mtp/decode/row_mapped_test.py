"""Row-mapped decoding: each row bit-identical to a batch of one, fillers and stops skipped."""

import dataclasses
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.decode import row_mapped
from mtp.decode import state as state_lib
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.decode import verification
from mtp.model import mtp_model
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


@pytest.mark.parametrize('choices', [[(0,), (1,)], [(0,), (0, 0)]], ids=['tree', 'chain'])
def test_a_verification_step_writes_the_cache_in_place(choices):
  """No step copies a layer's buffer: a row's block is written into it where it lies. Read back
  for a branching tree's attention, XLA:CPU fused that read with the write and copied each
  layer's values per row and step (SmolLM2 at 8,320 slots: its whole block cost 3.0 one-token
  steps, 1.45 without the copies)."""
  cfg = model_testing.tiny_config(head_type='eagle', mtp_num_heads=2)
  cfg = dataclasses.replace(cfg, trunk=dataclasses.replace(cfg.trunk, dtype='bfloat16',
                                                            max_seq_len=512))
  model = mtp_model.MTPModel(cfg, rngs=nnx.Rngs(0))
  tree = trees.tree_from_choices(choices)
  graphdef, params = nnx.split(model)
  b, capacity = 4, 512  # Several chunks: a cache of one chunk is read whole anyway.

  @functools.partial(jax.jit, donate_argnums=1)
  def steps(params, cache):
    m = row_mapped.RowMapped(nnx.merge(graphdef, params), jnp.ones((b,), bool))
    lengths = jnp.full((b,), 40, jnp.int32)
    positions = lengths[:, None] + jnp.asarray(tree.depth)[None]
    nodes = jnp.zeros((b, tree.num_nodes), jnp.int32)
    return jax.lax.fori_loop(0, 2, lambda _, c: verification.step(
        m, tree, nodes, positions, c, lengths, with_heads=False)[1], cache)

  program = steps.lower(params, model.init_cache(b, capacity)).compile().as_text()
  shape = ','.join(map(str, model.init_cache(b, capacity).keys[0].shape))
  copies = [line for line in program.splitlines() if f'[{shape}]' in line and ' copy(' in line]
  assert not copies, f'{len(copies)} copies of a cache buffer, e.g. {copies[0].strip()[:200]}'
