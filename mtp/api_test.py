"""mtp.load: round trip from a trained workdir, and clear errors for what is missing."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp
from mtp.checkpoint import checkpointing


@pytest.fixture(scope='module')
def workdir(tiny_workdir):
  return tiny_workdir


def test_load_returns_the_trained_model_and_tokenizer(workdir):
  loaded = mtp.load(workdir)
  assert loaded.step == 2
  assert loaded.tokenizer.kind == 'byte'
  assert loaded.config.model.mtp_num_heads == 3
  ids = jnp.asarray([loaded.tokenizer.encode('def f(x):')])
  out = loaded.model(ids, jnp.arange(ids.shape[1])[None])
  assert out.shape[:3] == (4, 1, ids.shape[1])
  assert np.isfinite(np.asarray(out)).all()


def test_missing_pieces_are_named(workdir, tmp_path):
  with pytest.raises(checkpointing.CheckpointError, match='not an mtp workdir'):
    mtp.load(tmp_path)
  with pytest.raises(checkpointing.CheckpointError, match='no step 7'):
    mtp.load(workdir, step=7)
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  shutil.rmtree(copy / 'checkpoints')
  with pytest.raises(checkpointing.CheckpointError, match='holds no checkpoint'):
    mtp.load(copy)


def test_a_corrupt_tokenizer_is_named(workdir, tmp_path):
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns('checkpoints', 'tensorboard'))
  (copy / 'tokenizer.json').write_text('{"truncated": ')
  with pytest.raises(ValueError, match=f'{copy / "tokenizer.json"} is corrupt'):
    mtp.load(copy)


PROMPTS = ['def add(a, b):\n    return', 'import os\n', 'class Point:\n    def __init__(self']


def test_a_model_loads_in_bfloat16_and_decodes_exactly_in_it(workdir):
  loaded = mtp.load(workdir, dtype='bfloat16')
  assert loaded.config.model.dtype == loaded.config.model.param_dtype == 'bfloat16'
  weights = nnx.state(loaded.model, nnx.Param)
  float32 = nnx.state(mtp.load(workdir).model, nnx.Param)
  for half, full in zip(jax.tree.leaves(weights), jax.tree.leaves(float32)):
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(half, full.astype(jnp.bfloat16))
  ar = mtp.generate(loaded, PROMPTS, max_new_tokens=12, decoder='autoregressive', batch_size=1)
  spec = mtp.generate(loaded, PROMPTS, max_new_tokens=12, batch_size=1)
  assert [g.tokens for g in spec] == [g.tokens for g in ar]
  with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float8'"):
    mtp.load(workdir, dtype='float8')



def test_generate_speculative_equals_autoregressive_greedy_across_batching(workdir):
  loaded = mtp.load(workdir)
  ar = mtp.generate(loaded, PROMPTS, max_new_tokens=12, decoder='autoregressive')
  spec = mtp.generate(loaded, PROMPTS, max_new_tokens=12, batch_size=2)  # Batches 2 + 1.
  assert [g.tokens for g in spec] == [g.tokens for g in ar]
  for g, prompt in zip(spec, PROMPTS):
    assert g.prompt == prompt
    assert g.completion == loaded.tokenizer.decode(g.tokens)
    assert g.num_prompt_tokens == len(loaded.tokenizer.encode(prompt))
    # 'auto' greedy adds 8 lookup drafts (verified only where they promise): depth 8.
    assert len(g.accepted_histogram) == max(loaded.config.model.mtp_num_heads, 8) + 2
    emitted = sum(j * c for j, c in enumerate(g.accepted_histogram))
    assert sum(g.accepted_histogram) == g.num_steps and emitted + 1 == len(g.tokens)
    assert g.mean_accepted == pytest.approx(emitted / max(g.num_steps, 1))
    assert g.tokens_per_sec > 0 and g.finish_reason in ('stop', 'length')
  assert all(g.mean_accepted == 1.0 or g.num_steps == 0 for g in ar)
  # One prompt as a string; the static default tree gives the same tokens.
  [one] = mtp.generate(workdir, PROMPTS[2], max_new_tokens=12, tree='default')
  assert one.tokens == ar[2].tokens
  # A tree as the --tree flag's JSON text: a chain of 2 drafts.
  [text] = mtp.generate(loaded, PROMPTS[2], max_new_tokens=12, tree='[[0], [0, 0]]', lookup=0)
  assert text.tokens == ar[2].tokens and len(text.accepted_histogram) == 2 + 2
  # With a prompt-lookup chain beside the heads' drafts.
  lookup = mtp.generate(loaded, PROMPTS, max_new_tokens=12, lookup=5)
  assert [g.tokens for g in lookup] == [g.tokens for g in ar]
  assert all(len(g.accepted_histogram) == 5 + 2 for g in lookup)


def test_generate_streams_the_same_text(workdir):
  loaded = mtp.load(workdir)
  pieces = {}
  finished = []

  def on_text(index, text, done):
    pieces[index] = pieces.get(index, '') + text
    if done:
      finished.append(index)

  out = mtp.generate(loaded, PROMPTS, max_new_tokens=12, batch_size=2, on_text=on_text,
                     steps_per_chunk=1)
  assert [pieces.get(i, '') for i in range(3)] == [g.completion for g in out]
  assert sorted(finished) == [0, 1, 2]


def test_generate_emits_only_ids_the_tokenizer_decodes(workdir):
  loaded = mtp.load(workdir)
  tokenizer = loaded.tokenizer
  assert tokenizer.vocab_size < loaded.model.cfg.trunk.vocab_size  # Spare output ids exist.
  for temperature in (1e3, 1e-45):
    for decoder in ('autoregressive', 'speculative'):
      for g in mtp.generate(loaded, PROMPTS, max_new_tokens=16, temperature=temperature,
                            decoder=decoder):
        assert all(t < tokenizer.vocab_size and t != tokenizer.pad_id for t in g.tokens)


def test_generate_sampling_is_seeded_whatever_the_batching(workdir):
  loaded = mtp.load(workdir)
  run = lambda seed, batch: [g.tokens for g in mtp.generate(
      loaded, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=seed,
      batch_size=batch, decoder='speculative')]
  assert run(1, None) == run(1, None) == run(1, 1) == run(1, 2)
  assert run(1, None) != run(2, None)


def test_generate_returns_the_models_logprobs(workdir):
  loaded = mtp.load(workdir)
  spec, ar = (mtp.generate(loaded, PROMPTS[:2], max_new_tokens=8, logprobs=2, decoder=decoder)
              for decoder in ('speculative', 'autoregressive'))
  for s, a in zip(spec, ar):
    assert s.tokens == a.tokens and len(s.logprobs) == len(s.tokens)
    np.testing.assert_allclose(s.logprobs, a.logprobs, atol=1e-5)
    assert [t for t, _ in s.top_logprobs[0]] == [t for t, _ in a.top_logprobs[0]]
    assert s.to_json()['logprobs'] == s.logprobs
  plain = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4)[0]
  assert plain.logprobs is None and 'logprobs' not in plain.to_json()


@pytest.mark.parametrize('kwargs,match', [
    (dict(prompts=['ok', '']), 'prompt 1 is empty'),
    (dict(prompts=[]), 'prompts is empty'),
    (dict(prompts=['x' * 250]), 'max_seq_len'),
    (dict(temperature=-1.0), 'temperature'),
    (dict(top_p=0.0), 'top_p'),
    (dict(decoder='beam'), 'decoder must be one of'),
    (dict(tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), 'exceeds the number of MTP heads'),
    (dict(tree='bushy'), 'tree must be one of .* or JSON choices like'),
    (dict(tree='[[0], [0,'), 'tree must be one of .* or JSON choices like'),
    (dict(decoder='autoregressive', tree='default'), 'apply to the drafting decoders'),
    (dict(batch_size=0), 'batch_size'),
    (dict(max_new_tokens=0), 'max_new_tokens must be a positive integer, got 0'),
    (dict(max_new_tokens=2.5), 'max_new_tokens must be a positive integer, got 2.5'),
    (dict(prompts=None), 'prompts must be a string or a list of strings'),
    (dict(temperature='0.5'), 'temperature must be >= 0 .* a finite number'),
    (dict(temperature=float('inf')), 'temperature must be >= 0 .* a finite number'),
    (dict(tree=[[0.5]]), 'not an integer'),
    (dict(tree=[[True]]), 'not an integer'),
    (dict(lookup=-1), r'lookup \(--lookup\) must be a non-negative integer'),
    (dict(lookup=1000), r'lookup \(--lookup\) must be at most'),
    (dict(lookup=3, decoder='autoregressive'), 'apply to the drafting decoders'),
    (dict(tree_budget=1), 'tree_budget must be an integer >= 2'),
    (dict(tree='dynamic', tree_budget=4, lookup=3), 'drafts from the heads alone'),
    (dict(decoder='autoregressive', tree_budget=4), 'apply to the drafting decoders'),
    (dict(logprobs=21), 'logprobs must be an integer in'),
    (dict(drafters=['beam']), 'drafters must be distinct names'),
])
def test_generate_rejects_bad_input_before_compiling(workdir, kwargs, match):
  from mtp.decode import engine
  loaded = mtp.load(workdir)
  args = {'prompts': ['x = 1'], 'max_new_tokens': 10, **kwargs}
  compiled = engine.compilations()
  with pytest.raises(ValueError, match=match):
    mtp.generate(loaded, args.pop('prompts'), **args)
  assert engine.compilations() == compiled


def test_generate_auto_tree_measures_and_caches_accuracies(workdir, monkeypatch):
  from mtp.decode import calibration
  from mtp.decode import cost_model
  from mtp.decode import measurements
  # cost_model_test covers measuring the curve; a fixed one keeps this test fast.
  curve = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0, 32: 6.0}
  asked = []
  monkeypatch.setattr(cost_model, 'step_cost',
                      lambda model, **kwargs: asked.append(kwargs) or curve)
  loaded = mtp.load(workdir)
  ar = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, decoder='autoregressive')
  [auto] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, tree='auto')
  assert auto.tokens == ar[0].tokens
  # The tree is priced by whole drafting steps at this batch size, as the loop runs them.
  assert asked and all(k['drafting'] and k['batch_size'] == 1 for k in asked)
  assert measurements.read_table('head_accuracies.json')  # Measured once, kept in the cache.
  acc = calibration.workdir_accuracies(loaded)
  assert acc.shape == (3, 4) and ((acc >= 0) & (acc <= 1)).all()
  # A dynamic tree sized as 'auto' sizes a static one (the same measurements), and the
  # default decoder ('auto') stops it where it does not pay: still exact.
  [dynamic] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, tree='dynamic')
  assert dynamic.tokens == ar[0].tokens
  assert len(dynamic.accepted_histogram) == 3 + 2  # The superset's depth: no lookup chain.


@pytest.mark.parametrize('entry', [
    '"oops"', '[[0.5, 0.5], [0.5]]', '[[0.5, 0.5, 0.5, 0.5]]',
    '[[2.0, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]',
    '[[NaN, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]', None])
def test_a_malformed_accuracy_cache_is_named_and_measured_again(workdir, tmp_path, monkeypatch,
                                                                caplog, entry):
  from mtp.decode import calibration
  from mtp.decode import measurements
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  loaded = mtp.load(workdir)
  measured = np.full((loaded.model.cfg.mtp_num_heads, 4), 0.25)
  calls = []
  real = calibration.calibrate
  monkeypatch.setattr(calibration, 'calibrate', lambda *a, **k: calls.append(1) or measured)
  calibration.workdir_accuracies(loaded)
  path = measurements.root() / 'head_accuracies.json'
  (key,) = measurements.read_table('head_accuracies.json')
  if entry is None:  # Not even JSON.
    path.write_bytes(b'{"step')
  else:
    path.write_text('{"%s": %s}' % (key, entry))
  with caplog.at_level('WARNING'):
    acc = calibration.workdir_accuracies(loaded)
  np.testing.assert_array_equal(acc, measured)
  assert calls == [1, 1]
  assert any(str(path) in r.getMessage() and 'measuring again' in r.getMessage()
             for r in caplog.records)
  np.testing.assert_array_equal(calibration.workdir_accuracies(loaded), measured)
  assert calls == [1, 1]  # Read back from the rewritten cache.
  assert not list(path.parent.glob('.*tmp'))  # No temporary left behind.
  del real


def test_chat_renders_the_template_and_reads_its_markers_as_special_ids(workdir):
  import dataclasses
  from mtp.data import tokenizer as tokenizer_lib
  loaded = mtp.load(workdir)
  plain = tokenizer_lib.Tokenizer(loaded.tokenizer.hf_tokenizer, loaded.tokenizer.special_ids,
                                  chat_template=None)
  with pytest.raises(ValueError, match='no chat template'):
    mtp.chat(dataclasses.replace(loaded, tokenizer=plain), [{'role': 'user', 'content': 'hi'}],
             max_new_tokens=4)
  template = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  tokenizer = tokenizer_lib.Tokenizer(loaded.tokenizer.hf_tokenizer,
                                      loaded.tokenizer.special_ids, chat_template=template)
  chatty = dataclasses.replace(loaded, tokenizer=tokenizer)
  reply = mtp.chat(chatty, [{'role': 'user', 'content': 'def f(x):'}], max_new_tokens=6,
                   decoder='autoregressive')
  rendered = '<bos>user: def f(x):\n'
  assert reply.prompt == rendered
  # The marker is one special id, not five bytes of text.
  assert reply.num_prompt_tokens == len(tokenizer.encode(rendered)) - 4
  (same,) = mtp.generate(chatty, rendered, max_new_tokens=6, decoder='autoregressive',
                         special_tokens=True)
  assert reply.tokens == same.tokens


def test_auto_drafts_over_its_default_draft_vocabulary_where_the_corpus_counts(
    workdir, tmp_path, monkeypatch, caplog):
  import dataclasses
  from mtp.decode import decoders
  from mtp.decode import draft_vocab
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))  # Counted afresh there.
  # The tiny model's 264 ids stand for a large vocabulary: auto's default is 16 ids here.
  monkeypatch.setitem(decoders.DECODERS, 'auto',
                      dataclasses.replace(decoders.get('auto'), draft_vocab=16))
  loaded = mtp.load(workdir)
  calls = []
  real = draft_vocab.draft_vocabulary
  monkeypatch.setattr(draft_vocab, 'draft_vocabulary',
                      lambda loaded, size: calls.append(size) or real(loaded, size))
  [ar] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, decoder='autoregressive')
  [auto] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, tree='chain', lookup=0)
  assert auto.tokens == ar.tokens and calls == [16]
  assert list((tmp_path / 'decode' / 'token_counts').glob('*.npy'))
  [whole] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, tree='chain', lookup=0,
                         draft_vocab=0)
  assert whole.tokens == ar.tokens and calls == [16]  # 0 names the whole vocabulary.

  def unreadable(loaded, size):
    raise FileNotFoundError('no such corpus')
  monkeypatch.setattr(draft_vocab, 'draft_vocabulary', unreadable)
  loaded = mtp.load(workdir)  # A fresh load: the decoder above is kept for this bucket.
  with caplog.at_level('WARNING'):
    [fallback] = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, tree='chain', lookup=0)
  assert fallback.tokens == ar.tokens
  assert 'Drafting over the whole vocabulary' in caplog.text and 'no such corpus' in caplog.text
  with pytest.raises(FileNotFoundError, match='no such corpus'):  # Named by the caller: raised.
    mtp.generate(loaded, PROMPTS[:1], max_new_tokens=10, lookup=0, draft_vocab=16)


def test_auto_fingerprints_a_loaded_models_weights_once_until_they_change(workdir, tmp_path,
                                                                          monkeypatch):
  """`auto` keys the heads' measured accuracies by the weights' fingerprints; reading every
  weight on each call cost SmolLM2 0.2-0.7 s, so a loaded model keeps them."""
  from mtp.checkpoint import fingerprint
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  loaded = mtp.load(workdir)
  counted = []
  real = fingerprint.fingerprints
  monkeypatch.setattr(fingerprint, 'fingerprints',
                      lambda tree: counted.append(1) or real(tree))
  first = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4, tree='auto')
  again = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4, tree='auto')
  assert counted == [1] and first[0].tokens == again[0].tokens
  assert loaded.weight_fingerprints() == real(nnx.state(loaded.model))
  embedding = loaded.model.trunk.embedding.embedding
  embedding.value = embedding.value.at[0, 0].add(1.0)  # Other weights: fingerprinted again.
  mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4, tree='auto')
  assert counted == [1, 1]
  assert loaded.weight_fingerprints() != real(nnx.state(mtp.load(workdir).model))


def test_a_loaded_model_is_prepared_once_until_its_weights_change(workdir, monkeypatch):
  from mtp.decode import state as state_lib
  loaded = mtp.load(workdir)
  made = []
  real = state_lib.PreparedModel.__init__
  monkeypatch.setattr(state_lib.PreparedModel, '__init__',
                      lambda self, *a, **k: made.append(1) or real(self, *a, **k))
  first = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4, decoder='autoregressive')
  again = mtp.generate(loaded, PROMPTS[:2], max_new_tokens=4, decoder='speculative')
  assert made == [1] and loaded.prepared() is loaded.prepared()
  # A replaced weight (arrays are immutable: an update is a new array) prepares again.
  embedding = loaded.model.trunk.embedding.embedding
  embedding.value = embedding.value + 0
  third = mtp.generate(loaded, PROMPTS[:1], max_new_tokens=4, decoder='autoregressive')
  assert made == [1, 1]
  assert first[0].tokens == third[0].tokens == again[0].tokens
