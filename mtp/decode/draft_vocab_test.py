"""Draft vocabularies (FR-Spec): ranking, a corpus's cached counts, and decoding with one.

Decoding through a draft vocabulary stays exact (greedy output equals autoregressive output,
chains and trees, every family that feeds its drafts back), drafts never leave the draft
vocabulary nor the emittable ids, and a draft vocabulary of all V ids drafts what the whole
vocabulary drafts.
"""

import logging

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import draft_vocab
from mtp.decode import engine as engine_lib
from mtp.decode import measurements
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import testing

VOCAB = 61
MAX_NEW = 16
PROMPT_LENGTHS = np.array([7, 3, 5], np.int32)
TREE = trees.tree_from_choices([(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)])
# A fixed "frequency order" of every id, and the first 16 of it as a small draft vocabulary.
ORDER = np.random.default_rng(7).permutation(VOCAB).astype(np.int32)
SMALL = ORDER[:16]


# ------------------------------------------------------------------------------------------
# Counting and ranking (numpy).
# ------------------------------------------------------------------------------------------


def test_count_tokens_and_top_ids_break_ties_by_id():
  counts = draft_vocab.count_tokens([np.array([[3, 1], [3, 0]]), np.array([5, 1, 3, 5])], 7)
  np.testing.assert_array_equal(counts, [1, 2, 0, 3, 0, 2, 0])
  assert counts.dtype == np.int64
  # 3 (x3), then 1 and 5 (x2, lower id first), then 0, then the unseen ids by id.
  np.testing.assert_array_equal(draft_vocab.top_ids(counts, 7), [3, 1, 5, 0, 2, 4, 6])
  np.testing.assert_array_equal(draft_vocab.top_ids(counts, 2), [3, 1])
  # Ids never emitted rank last, whatever their counts.
  np.testing.assert_array_equal(draft_vocab.top_ids(counts, 7, excluded=[3], limit=6),
                                [1, 5, 0, 2, 4, 3, 6])
  assert draft_vocab.top_ids(counts, 3).dtype == np.int32


@pytest.mark.parametrize('n', [0, 8, -1, 2.0, True, None])
def test_top_ids_names_a_bad_size(n):
  with pytest.raises(ValueError, match=r'draft_vocab must be an integer in \[1, 7\]'):
    draft_vocab.top_ids(np.ones(7, np.int64), n)


def test_count_tokens_and_check_ids_refuse_bad_ids():
  with pytest.raises(ValueError, match=r'token id 9 is outside the vocabulary \[0, 7\)'):
    draft_vocab.count_tokens([np.array([1, 9])], 7)
  with pytest.raises(ValueError, match=r'must be \[3\] integer ids'):
    draft_vocab.check_ids([1, 2], 3, 7)
  with pytest.raises(ValueError, match=r'must lie in \[0, 7\)'):
    draft_vocab.check_ids([1, 2, 7], 3, 7)
  with pytest.raises(ValueError, match='distinct'):
    draft_vocab.check_ids([1, 2, 1], 3, 7)


# ------------------------------------------------------------------------------------------
# A corpus's counts, cached.
# ------------------------------------------------------------------------------------------


@pytest.fixture
def corpus_config(tmp_path):
  root = tmp_path / 'corpus'
  for i in range(12):
    path = root / f'mod{i}.py'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'def f{i}(x):\n    return x * {i}\n' * (3 + i))
  return ml_collections.ConfigDict({'data': {
      'corpus': str(root), 'extensions': ('.py',), 'valid_fraction': 0.2, 'tokenizer': 'byte',
      'seq_len': 32, 'max_corpus_bytes': -1, 'source': ''}})


def test_corpus_counts_count_the_training_split_once(corpus_config, tmp_path, monkeypatch,
                                                     caplog):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  tok = tokenizer_lib.byte_tokenizer()
  workdir = tmp_path / 'workdir'
  workdir.mkdir()
  counts = draft_vocab.corpus_counts(corpus_config, tok, 264, workdir)
  train = pipeline.split_texts(corpus_config.data, 'train')
  # Every byte of every training file, plus one EOS per file; no padding.
  assert counts.sum() == sum(len(t.encode()) + 1 for t in train)
  (x,) = tok.encode('x')
  assert counts[x] == sum(t.count('x') for t in train) > 0
  [cached] = (measurements.root() / 'token_counts').glob('*.npy')
  np.testing.assert_array_equal(np.load(cached), counts)
  assert not list(cached.parent.glob('.*tmp'))

  # Cached: counting again is not needed.
  monkeypatch.setattr(draft_vocab, '_corpus_counts', lambda *a: pytest.fail('counted again'))
  np.testing.assert_array_equal(draft_vocab.corpus_counts(corpus_config, tok, 264, workdir),
                                counts)

  # A corrupt or mismatched cache is named and counted again.
  monkeypatch.undo()
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  cached.write_bytes(b'not numpy')
  with caplog.at_level(logging.WARNING):
    again = draft_vocab.corpus_counts(corpus_config, tok, 264, workdir)
  assert 'measurement cache' in caplog.text and cached.name in caplog.text
  np.testing.assert_array_equal(again, counts)
  caplog.clear()
  np.save(cached, counts[:10])
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(draft_vocab.corpus_counts(corpus_config, tok, 264, workdir),
                                  counts)
  assert 'token-count cache' in caplog.text


# ------------------------------------------------------------------------------------------
# Plans.
# ------------------------------------------------------------------------------------------


def _engine(model, **options):
  return decode_testing.engine(model, max_new_tokens=MAX_NEW, **options)


def test_the_plan_checks_the_draft_vocabulary():
  model = testing.tiny_model(0, mtp_num_heads=3)
  assert _engine(model, draft_vocab=SMALL).plan.draft_vocab_size == 16
  assert _engine(model).plan.draft_vocab_size == 0
  for bad in (-1, VOCAB + 1, 2.5, True):
    with pytest.raises(ValueError, match=r'draft_vocab \(--draft_vocab\) must be an integer in '
                                         r'\[0, 61\]'):
      _engine(model, draft_vocab=bad)
  with pytest.raises(ValueError, match="'autoregressive' drafts nothing with heads"):
    _engine(model, decoder='autoregressive', draft_vocab=SMALL)
  with pytest.raises(ValueError, match="'auto' drafts nothing with heads"):
    _engine(testing.tiny_model(0, mtp_num_heads=0), decoder='auto', draft_vocab=SMALL)
  with pytest.raises(ValueError, match=r"top-3 drafts of a head, more than the draft "
                                       r"vocabulary's 2 ids"):
    _engine(model, tree=TREE, draft_vocab=SMALL[:2])
  with pytest.raises(ValueError, match='distinct'):
    _engine(model, draft_vocab=np.zeros(16, np.int32))
  with pytest.raises(ValueError, match='counts the training corpus'):
    _engine(model, draft_vocab=16)  # A size needs a workdir's corpus to count.


# ------------------------------------------------------------------------------------------
# Decoding.
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def prompts():
  return testing.random_tokens((3, 7), VOCAB, seed=1)


@pytest.fixture(scope='module')
def reference(prompts):
  return decode_testing.decode(testing.tiny_model(0, mtp_num_heads=0), prompts, PROMPT_LENGTHS,
                               max_new_tokens=MAX_NEW, decoder='autoregressive')


@pytest.mark.parametrize('head_type,tree', [
    ('medusa', None), ('medusa', TREE), ('sequential', TREE), ('eagle', None),
    ('eagle3', TREE)],
    ids=['medusa-chain', 'medusa-tree', 'sequential-tree', 'eagle-chain', 'eagle3-tree'])
def test_greedy_output_with_a_draft_vocab_equals_autoregressive(prompts, reference, head_type,
                                                               tree):
  model = decode_testing.head_model(head_type)  # The head-less reference's trunk.
  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                              tree=tree, draft_vocab=SMALL)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)


def _slots(model, prompts, tree, ids, steps, **options):
  """Drafts [B, N - 1] after the prefill and after each of `steps` loop steps, and the
  tokens."""
  engine = _engine(model, tree=tree, draft_vocab=ids, **options)
  state = engine.prefill(prompts, PROMPT_LENGTHS, decode_testing.settings(
      engine, prompts.shape[0], max_new_tokens=MAX_NEW))
  drafts = [np.asarray(state.drafters[0].drafts)]
  for _ in range(steps):
    state = engine.step(state, 1)
    drafts.append(np.asarray(state.drafters[0].drafts))
  return np.stack(drafts), engine.result(state).tokens


@pytest.mark.parametrize('head_type,tree', [('medusa', TREE), ('sequential', None),
                                            ('eagle', None), ('eagle3', None)])
def test_all_ids_in_any_order_draft_what_the_whole_vocabulary_drafts(prompts, head_type, tree):
  model = decode_testing.head_model(head_type)
  full, full_tokens = _slots(model, prompts, tree, None, steps=3)
  ordered, ordered_tokens = _slots(model, prompts, tree, ORDER, steps=3)
  np.testing.assert_array_equal(ordered, full)
  np.testing.assert_array_equal(ordered_tokens, full_tokens)


def test_the_heads_project_onto_the_draft_vocabulary_rows():
  """Logits over a draft vocabulary are the full logits at its ids, for every family, and the
  families that feed their drafts back (sequential, eagle) feed back full ids."""
  for head_type in ('eagle', 'eagle3', 'medusa', 'parallel', 'sequential'):
    for tie in (True, False):
      model = decode_testing.head_model(head_type, tie_embeddings=tie)
      tokens = jnp.asarray(testing.random_tokens((2, 9), VOCAB))
      positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
      lengths = jnp.zeros(2, jnp.int32)
      out, cache = model.step(tokens[:, :6], positions, model.init_cache(2, 16), lengths)
      last = jnp.asarray([5, 2])
      full, _ = model.draft_logits(out.features, tokens, last, cache, lengths, 3)
      ordered, _ = model.draft_logits(out.features, tokens, last, cache, lengths, 3,
                                      vocab=jnp.asarray(ORDER))
      np.testing.assert_allclose(ordered, np.asarray(full)[..., ORDER], rtol=1e-5, atol=1e-5,
                                 err_msg=f'{head_type} tied={tie}')
      # Rows gathered once ahead (as the decode loop does) project alike.
      gathered, _ = model.draft_logits(out.features, tokens, last, cache, lengths, 3,
                                       vocab=model.draft_vocab(jnp.asarray(ORDER)))
      np.testing.assert_allclose(gathered, ordered, rtol=1e-6, atol=1e-6)
      small, _ = model.draft_logits(out.features, tokens, last, cache, lengths, 1,
                                    vocab=jnp.asarray(SMALL))
      np.testing.assert_allclose(small, np.asarray(full)[:1, :, SMALL], rtol=1e-5, atol=1e-5)


def test_drafts_stay_inside_the_draft_vocabulary_and_the_emittable_ids(prompts):
  model = testing.tiny_model(0, head_type='medusa')
  banned, limit = int(SMALL[0]), 50  # The most frequent id is banned; ids >= 50 too.
  drafts, _ = _slots(model, prompts, TREE, SMALL, steps=4, emittable_ids=(limit, (banned,)))
  allowed = [i for i in SMALL if i != banned and i < limit]
  assert len(allowed) >= 3  # The tree's top-3 can all be allowed ids.
  assert np.isin(drafts, allowed).all(), drafts


def test_a_new_draft_vocabulary_of_the_same_size_does_not_recompile(prompts, reference):
  model = testing.tiny_model(0, head_type='medusa')
  decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                        draft_vocab=SMALL)
  compiled = engine_lib.compilations()
  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                              draft_vocab=ORDER[-16:])
  assert engine_lib.compilations() == compiled
  np.testing.assert_array_equal(out.tokens, reference.tokens)


def test_sampling_with_a_draft_vocabulary_runs(prompts):
  model = testing.tiny_model(0, head_type='medusa')
  out = decode_testing.decode(model, prompts, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                              tree=TREE, temperature=1.0, seed=3, draft_vocab=SMALL)
  tokens = np.asarray(out.tokens)
  np.testing.assert_array_equal(out.num_generated, MAX_NEW)
  assert ((tokens >= 0) & (tokens < VOCAB)).all()
  assert np.asarray(out.num_steps).max() <= MAX_NEW - 1


# ------------------------------------------------------------------------------------------
# mtp.generate(draft_vocab=N) on a trained workdir.
# ------------------------------------------------------------------------------------------


def test_generate_with_a_draft_vocab_counts_once_and_keeps_the_output(tiny_workdir, tmp_path,
                                                                      monkeypatch):
  import mtp  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  loaded = mtp.load(tiny_workdir)
  prompts = ['def f(x):\n    return', 'import os\n']
  options = dict(max_new_tokens=12, decoder='speculative', tree='default')
  full = mtp.generate(loaded, prompts, **options)
  small = mtp.generate(loaded, prompts, draft_vocab=32, **options)
  assert [g.tokens for g in small] == [g.tokens for g in full]
  [cached] = (measurements.root() / 'token_counts').glob('*.npy')
  counts = np.load(cached)
  ids = draft_vocab.draft_vocabulary(loaded, 32)
  np.testing.assert_array_equal(ids, draft_vocab.top_ids(counts, 32, excluded=(),
                                                         limit=loaded.tokenizer.vocab_size))
  assert counts[ids].min() >= np.delete(counts, ids).max()  # The most frequent ids.
  with pytest.raises(ValueError, match=r'draft_vocab \(--draft_vocab\) must be an integer'):
    mtp.generate(loaded, prompts, draft_vocab=10**6, **options)
  with pytest.raises(ValueError, match='drafts nothing with heads'):
    mtp.generate(loaded, prompts, max_new_tokens=4, decoder='autoregressive', draft_vocab=32)
