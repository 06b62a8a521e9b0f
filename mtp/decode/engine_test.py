"""The engine, the one door into the decode loop: per-row settings as data (one compiled
decoder for every mix), seeds that hold whatever the batch, continuous batching, logprobs."""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from scipy import stats

import mtp
from mtp.decode import engine as engine_lib
from mtp.decode import loop
from mtp.decode import settings as settings_lib
from mtp.decode import state as state_lib
from mtp.decode import testing as decode_testing
from mtp.model import mtp_model
from mtp.model import testing

PROMPT_LENGTHS = np.array([7, 3, 5], np.int32)
MAX_NEW = 16
WIDTH = 8


@pytest.fixture(scope='module')
def model():
  return testing.tiny_model(0)


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((3, 7), 61, seed=1)


def _settings(engine, samplings, indices=None):
  return engine.settings(samplings, indices)


@pytest.mark.parametrize('decoder', ['autoregressive', 'speculative', 'auto'])
def test_one_compilation_across_prompts_lengths_settings_seeds_stops_and_chunks(model, decoder):
  engine = decode_testing.engine(model, decoder, max_new_tokens=MAX_NEW, exact=True)
  rng = np.random.default_rng(0)
  compiled = None
  for call in range(4):
    prompts = testing.random_tokens((3, WIDTH), 61, seed=call)
    lengths = rng.integers(1, WIDTH + 1, 3)
    samplings = [settings_lib.Sampling(
        max_tokens=int(rng.integers(1, MAX_NEW + 1)), temperature=float(t), top_k=int(k),
        top_p=float(p), seed=call * 7 + row, stop_ids=(call + 5,))
        for row, (t, k, p) in enumerate(zip([0.0, 0.7, 1.3], [0, 20, 3], [1.0, 0.9, 0.5]))]
    out = engine.generate(prompts, lengths, _settings(engine, samplings), pad_id=call)
    np.testing.assert_array_less(out.num_generated - 1,
                                 [s.max_tokens for s in samplings])  # Each row's own budget.
    chunks = list(engine.chunks(prompts, lengths, _settings(engine, samplings),
                                steps_per_chunk=call + 1, pad_id=call))
    np.testing.assert_array_equal(chunks[-1].tokens, out.tokens)  # Same seeds, same output.
    if compiled is None:
      compiled = engine_lib.compilations()
    assert engine_lib.compilations() == compiled, engine_lib.COMPILATIONS.by_kind()


def test_a_row_decodes_the_same_alone_and_in_any_batch(model, prompts):
  """Row-mapped rows: greedy rows equal their batch of one, and a seeded sampled row draws the
  same tokens alone, beside other settings, or at another row with another neighbour."""
  engine = decode_testing.engine(model, 'speculative', max_new_tokens=MAX_NEW, exact=True)
  greedy = settings_lib.Sampling(max_tokens=MAX_NEW)
  sampled = settings_lib.Sampling(max_tokens=MAX_NEW, temperature=0.8, seed=42)
  other = settings_lib.Sampling(max_tokens=5, temperature=1.5, top_k=4, seed=7)

  def alone(row, sampling):
    return engine.generate(prompts[row:row + 1], PROMPT_LENGTHS[row:row + 1],
                           _settings(engine, [sampling])).tokens[0]

  batch = engine.generate(prompts, PROMPT_LENGTHS, _settings(engine, [greedy, sampled, other]))
  np.testing.assert_array_equal(batch.tokens[0], alone(0, greedy))
  np.testing.assert_array_equal(batch.tokens[1], alone(1, sampled))
  swapped = engine.generate(prompts[[2, 1, 0]], PROMPT_LENGTHS[[2, 1, 0]],
                            _settings(engine, [greedy, sampled, greedy]))
  np.testing.assert_array_equal(swapped.tokens[1], batch.tokens[1])
  assert batch.num_generated[2] <= 5


@pytest.mark.parametrize('joining', ['whole_batch', 'one_by_one'])
def test_rows_join_and_leave_a_running_batch(model, prompts, joining):
  """Continuous batching through the door: rows prefilled into a running state (in a prefill
  of the whole batch, or each in a prefill of its own) decode what a batch of one decodes,
  whenever they joined, a seeded sampled row too; evicted rows stop."""
  engine = decode_testing.engine(model, 'speculative', max_new_tokens=MAX_NEW, exact=True)
  samplings = [settings_lib.Sampling(max_tokens=MAX_NEW),
               settings_lib.Sampling(max_tokens=MAX_NEW, temperature=0.8, seed=3),
               settings_lib.Sampling(max_tokens=MAX_NEW)]
  want = engine.generate(prompts, PROMPT_LENGTHS, _settings(engine, samplings))
  first = np.array([True, False, False])
  state = engine.prefill(prompts, PROMPT_LENGTHS, _settings(engine, samplings), first)
  state = engine.step(state, 3)
  later = np.array([False, True, True])
  if joining == 'whole_batch':
    state = engine.insert(state, engine.prefill(prompts, PROMPT_LENGTHS,
                                                _settings(engine, samplings), later), later)
  else:
    for row in np.flatnonzero(later):
      fresh = engine.prefill(prompts[row:row + 1], PROMPT_LENGTHS[row:row + 1],
                             _settings(engine, samplings[row:row + 1]))
      state = engine.insert(state, fresh, np.arange(3) == row)
    with pytest.raises(ValueError, match='2 rows marked for a fresh state of 1 rows'):
      engine.insert(state, fresh, later)
  state = engine.step(state, 2)
  state = engine.evict(state, np.array([False, False, True]))
  evicted = engine.result(state)
  assert evicted.finish_reason(2) == 'cancelled'
  state = engine.step(state, MAX_NEW)
  out = engine.result(state)
  np.testing.assert_array_equal(out.tokens[:2], want.tokens[:2])
  assert out.num_generated[2] == evicted.num_generated[2] < MAX_NEW
  assert [out.finish_reason(r) for r in range(3)] == ['length', 'length', 'cancelled']


@pytest.mark.parametrize('decoder', ['autoregressive', 'auto'])
def test_a_chunk_returns_when_a_row_ends_if_asked(model, prompts, decoder):
  """`step(..., until_a_row_ends=True)` returns once a row ends (a server answers it and fills
  its row at once), and the rows that run on decode what they would have decoded."""
  engine = decode_testing.engine(model, decoder, max_new_tokens=MAX_NEW, exact=True)
  samplings = [settings_lib.Sampling(max_tokens=n) for n in (MAX_NEW, 4, MAX_NEW)]
  want = engine.generate(prompts, PROMPT_LENGTHS, _settings(engine, samplings))
  state = engine.step(engine.prefill(prompts, PROMPT_LENGTHS, _settings(engine, samplings)),
                      MAX_NEW, until_a_row_ends=True)
  early = engine.result(state)
  assert early.finish_reason(1) == 'length' and early.num_generated[1] >= 4
  assert all(early.finish_reason(r) is None for r in (0, 2))
  assert np.all(early.num_generated[[0, 2]] < MAX_NEW)
  for _ in range(2):  # The other two rows end in one step or in two.
    state = engine.step(state, MAX_NEW, until_a_row_ends=True)
  assert not engine.running(state)
  out = engine.result(engine.step(state, MAX_NEW, until_a_row_ends=True))  # None runs.
  np.testing.assert_array_equal(out.tokens, want.tokens)
  np.testing.assert_array_equal(out.num_steps, want.num_steps)


def test_stop_ids_end_each_row_and_pad_after(model, prompts):
  reference = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder='autoregressive',
                                    max_new_tokens=MAX_NEW)
  eos = int(reference.tokens[1, 4])
  for decoder in ('autoregressive', 'speculative'):
    out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder=decoder,
                                max_new_tokens=MAX_NEW, eos_id=eos, pad_id=-1)
    for b in range(3):
      hits = np.nonzero(reference.tokens[b] == eos)[0]
      n = hits[0] + 1 if hits.size else MAX_NEW
      assert out.num_generated[b] == n
      np.testing.assert_array_equal(out.tokens[b, :n], reference.tokens[b, :n])
      assert np.all(out.tokens[b, n:] == -1)
      assert out.finish_reason(b) == ('stop' if hits.size else 'length')


def test_chunks_yield_growing_prefixes_of_the_same_output(model, prompts):
  engine = decode_testing.engine(model, 'autoregressive', max_new_tokens=MAX_NEW)
  rows = decode_testing.settings(engine, 3, max_new_tokens=MAX_NEW)
  chunks = list(engine.chunks(prompts, PROMPT_LENGTHS, rows, steps_per_chunk=4))
  assert [c.num_generated.tolist() for c in chunks] == [[n] * 3 for n in (1, 5, 9, 13, 16)]
  np.testing.assert_array_equal(chunks[-1].tokens, engine.generate(
      prompts, PROMPT_LENGTHS, decode_testing.settings(engine, 3, max_new_tokens=MAX_NEW)).tokens)


# Ids a tokenizer of 50 ids with pad 0 can emit, from a model whose output layer has 61.
VOCAB_LIMIT, PAD = 50, 0
ROWS, NEW = 96, 3


def _emitted(model, decoder, temperature, seed):
  out = decode_testing.decode(model, testing.random_tokens((ROWS, 4), 61, seed=9),
                              max_new_tokens=NEW, decoder=decoder, temperature=temperature,
                              seed=seed, emittable_ids=(VOCAB_LIMIT, (PAD,)))
  return np.asarray(out.tokens)


@pytest.mark.parametrize('temperature', [1e-30, 1e-10, 1.0, 1e3])
def test_every_temperature_emits_decodable_ids_alike_in_both_decoders(model, temperature):
  """Tiny temperatures once made the rejection sampler emit pad ids (softmax(logits / T) was
  NaN); huge ones sampled ids past the tokenizer. Both decoders mask alike and agree."""
  ar = _emitted(model, 'autoregressive', temperature, 1)
  spec = _emitted(model, 'speculative', temperature, 2)
  for tokens in (ar, spec):
    assert np.all((tokens > PAD) & (tokens < VOCAB_LIMIT)), np.unique(tokens)
  if temperature <= 1e-10:  # Sampling at such temperatures is greedy decoding.
    greedy = _emitted(model, 'autoregressive', 0.0, 0)
    np.testing.assert_array_equal(ar, greedy)
    np.testing.assert_array_equal(spec, greedy)
  else:  # The same distribution: a two-sample chi-square test on every emitted token.
    counts = np.stack([np.bincount(t.ravel(), minlength=VOCAB_LIMIT) for t in (ar, spec)])
    counts = counts[:, counts.sum(0) > 0]
    assert stats.chi2_contingency(counts)[1] > 1e-4


def test_logprobs_are_the_models_and_equal_under_speculation(model, prompts):
  """Each emitted token's log-probability is the trunk's (temperature 1), the same whether the
  token came from a verified draft or a one-token step, and the top alternatives are sorted."""
  results = {}
  for decoder, options in (('autoregressive', {}), ('speculative', dict(lookup=4))):
    results[decoder] = decode_testing.decode(model, prompts, PROMPT_LENGTHS, decoder=decoder,
                                             max_new_tokens=MAX_NEW, logprobs=3, **options)
  ar, spec = results['autoregressive'], results['speculative']
  np.testing.assert_array_equal(ar.tokens, spec.tokens)
  assert np.asarray(spec.accepted_histogram)[:, 2:].sum() > 0  # Some drafts were accepted.
  np.testing.assert_allclose(spec.logprobs, ar.logprobs, atol=1e-5)
  np.testing.assert_array_equal(spec.top_ids, ar.top_ids)
  # The chosen greedy token is the top alternative, and values descend.
  np.testing.assert_array_equal(ar.top_ids[..., 0], ar.tokens)
  np.testing.assert_allclose(ar.top_logprobs[..., 0], ar.logprobs, atol=1e-6)
  assert np.all(np.diff(ar.top_logprobs, axis=-1) <= 0)
  assert np.all(ar.logprobs < 0) and ar.top_ids.shape == (3, MAX_NEW, 3)


def test_a_tokens_logprobs_have_one_value_alone_in_a_batch_and_under_speculation(tiny_workdir):
  """In bfloat16 on CPU (row-invariant products, `products`) a token's log-probability and its
  alternatives' have the same bits whether it was decoded alone or in a batch, by a one-token
  step or verified in a block: their normaliser is summed in a fixed order. (With
  jax.nn.log_softmax, 4 of these 6 prompts took other bits in a batch under speculation.)"""
  loaded = mtp.load(tiny_workdir, dtype='bfloat16')
  prompts = [f'def g{i}(y):' for i in range(6)]

  def decode(decoder, batch_size):
    return mtp.generate(loaded, prompts, max_new_tokens=8, decoder=decoder, logprobs=3,
                        batch_size=batch_size)
  alone = decode('autoregressive', 1)
  speculative = decode('speculative', 1), decode('speculative', 6)
  assert all(sum(sum(g.accepted_histogram[2:]) for g in out) for out in speculative)
  for out in (decode('autoregressive', 6),) + speculative:
    for got, want in zip(out, alone):
      assert got.tokens == want.tokens
      np.testing.assert_array_equal(np.float32(got.logprobs), np.float32(want.logprobs))
      np.testing.assert_array_equal(np.float32(got.top_logprobs), np.float32(want.top_logprobs))


@pytest.mark.parametrize('change,message', [
    (dict(prompt_lengths=[7, 0, 5]), 'empty prompt in row 1'),
    (dict(max_new_tokens=122), 'exceeds the model position limit max_seq_len=128'),
    (dict(max_new_tokens=0), 'max_new_tokens must be'),
    (dict(temperature=-0.5), 'temperature must be >= 0'),
    (dict(top_p=0.0), r'top_p must be in \(0, 1\]'),
    (dict(top_k=-1), 'top_k must be >= 0'),
    (dict(eos_id=61), 'stop id 61 is outside the vocabulary'),
    (dict(logprobs=21), r'logprobs must be an integer in \[-1, 20\]'),
])
def test_bad_input_is_named_before_compiling(model, prompts, change, message):
  kwargs = {**dict(prompt_lengths=PROMPT_LENGTHS, max_new_tokens=4), **change}
  lengths = kwargs.pop('prompt_lengths')
  compiled = engine_lib.compilations()
  with pytest.raises(ValueError, match=message):
    decode_testing.decode(model, prompts, lengths, decoder='autoregressive', **kwargs)
  assert engine_lib.compilations() == compiled


def test_a_sampled_row_in_a_greedy_only_plan_is_refused(model):
  engine = decode_testing.engine(model, 'autoregressive', max_new_tokens=4, greedy_only=True)
  with pytest.raises(ValueError, match='greedy rows only'):
    engine.settings([settings_lib.Sampling(max_tokens=4, temperature=0.5)])


def test_token_outside_vocabulary_is_named(model):
  bad = np.array([[1, 2, 3], [4, 61, 0]])
  with pytest.raises(ValueError, match=r'token id 61 at prompt row 1, position 1'):
    decode_testing.decode(model, bad, decoder='autoregressive', max_new_tokens=2)
  with pytest.raises(ValueError, match='empty prompt'):
    decode_testing.decode(model, np.zeros((1, 0), np.int32), decoder='autoregressive',
                          max_new_tokens=2)


def test_pad_prompts():
  tokens, lengths = state_lib.pad_prompts([[5, 6, 7], [8]], pad_id=9, multiple=4)
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 9], [8, 9, 9, 9]])
  np.testing.assert_array_equal(lengths, [3, 1])


def test_decoding_fuses_projections_on_cpu_and_gives_the_same_tokens(model):
  prompts = testing.random_tokens((2, 5), 61, seed=4)
  assert state_lib.prepare(model).fused  # This suite runs on CPU.
  for decoder in ('autoregressive', 'speculative'):
    fused, unfused = (decode_testing.decode(state_lib.prepare(model, fuse=fuse), prompts,
                                            decoder=decoder, max_new_tokens=12)
                      for fuse in (True, False))
    np.testing.assert_array_equal(fused.tokens, unfused.tokens)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_row_decodes_the_same_wherever_its_prompts_prefill_chunks_fall(dtype, monkeypatch):
  """The prefill's long chunks are the batch's (its longest prompt's whole long chunks, then
  short ones). A 300-token prompt alone (one long chunk, then short ones) gives the same
  tokens and log-probabilities, bit for bit, as in short chunks only, its first drafts (made
  in the prefill) included. Beside a 600-token prompt (two long chunks) it gives the same
  tokens, and in bfloat16 the same bits (float32 products at this width change a row's last
  bits with the batch's size, whatever the chunks)."""
  cfg = testing.tiny_config(head_type='eagle')
  trunk = dataclasses.replace(cfg.trunk, max_seq_len=640, dtype=dtype, param_dtype=dtype)
  model = mtp_model.MTPModel(dataclasses.replace(cfg, trunk=trunk), rngs=nnx.Rngs(0))
  prompts = testing.random_tokens((2, 600), 61, seed=5)
  lengths = np.array([300, 600], np.int32)
  assert loop.LONG_PREFILL_CHUNK == 256 and loop.PREFILL_CHUNK == 64

  def decode(rows):
    return decode_testing.decode(model, prompts[rows], lengths[rows], decoder='speculative',
                                 max_new_tokens=12, logprobs=2)

  alone, beside = decode([0]), decode([0, 1])
  monkeypatch.setattr(loop, 'LONG_PREFILL_CHUNK', 10_000)
  short = decode([0])
  np.testing.assert_array_equal(beside.tokens[0], alone.tokens[0])
  for other in (short,) + ((beside,) if dtype == 'bfloat16' else ()):
    np.testing.assert_array_equal(other.tokens[0], alone.tokens[0])
    np.testing.assert_array_equal(other.logprobs[0], alone.logprobs[0])
    np.testing.assert_array_equal(other.accepted_histogram[0], alone.accepted_histogram[0])


@pytest.mark.parametrize('exact', [True, False], ids=['rows', 'batch'])
def test_no_engine_program_copies_a_cache_buffer(exact):
  """The KV cache is written in place: a program that copies a layer's buffer pays for the
  cache's whole capacity, not for what it does. An eviction, which changes one field, copied
  the whole cache to return it (SmolLM2's server: 64-194 ms an eviction, now under 1 ms).
  Mapped rows' branching block in bfloat16 copied each layer's values while its attention read
  the block back from the cache (XLA:CPU fused the read with the write): SmolLM2's whole block
  at 8,320 slots cost 3.0 one-token steps, now 1.4."""
  cfg = testing.tiny_config(head_type='eagle', mtp_num_heads=2)
  trunk = dataclasses.replace(cfg.trunk, max_seq_len=512, dtype='bfloat16')
  model = mtp_model.MTPModel(dataclasses.replace(cfg, trunk=trunk), rngs=nnx.Rngs(0))
  engine = decode_testing.engine(model, 'auto', max_new_tokens=400, tree='[[0], [1], [0, 0]]',
                                 lookup=3, batch_size=2, exact=exact)
  state = engine.prefill(*state_lib.pad_prompts([[1, 2, 3], [4, 5]]),
                         _settings(engine, [settings_lib.Sampling(max_tokens=8)] * 2))
  capacity = engine.plan.capacity
  assert capacity >= 4 * 128  # Several chunks: a cache of one chunk is read whole anyway.
  for name, program in engine.compiled_text(state).items():
    copies = [line.strip() for line in program.splitlines()
              if ' copy(' in line and f',{capacity},' in line]
    assert not copies, f'{name}: {len(copies)} copies of cache buffers, e.g. {copies[0][:200]}'
