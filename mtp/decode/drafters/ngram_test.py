"""N-gram drafts from the corpus's tables: the most frequent continuations, exact decoding, and a
drafter added as one module (the proof of the plug-in)."""

import jax.numpy as jnp
import numpy as np

import mtp
from mtp.decode import measurements
from mtp.decode import testing as decode_testing
from mtp.decode.drafters import ngram
from mtp.model import testing


def test_tables_hold_the_most_frequent_continuations():
  # After 1: 2 twice, 3 once; after (1, 2): 5 twice, 4 once; 7 never continues.
  tokens = np.array([1, 2, 5, 1, 2, 5, 1, 2, 4, 1, 3, 7])
  tables = ngram.count_tables(tokens, 10)
  assert tables.bigram[1] == 2 and tables.bigram[2] == 5 and tables.bigram[7] == 7
  slot = ngram._slot(np.array([1]), np.array([2]), tables.pair_a.shape[0])[0]
  assert (tables.pair_a[slot], tables.pair_b[slot], tables.pair_next[slot]) == (1, 2, 5)


def test_the_chain_follows_the_tables_and_backs_off_to_bigrams():
  tables = ngram.count_tables(np.array([1, 2, 5, 1, 2, 5, 6, 8, 9]), 10)
  drafter = ngram.NgramDrafter(length=3)
  drafts = drafter._chain(jnp.asarray([1, 0]), jnp.asarray([2, 6]),
                          ngram.Tables(*map(jnp.asarray, (tables.bigram, tables.pair_a,
                                                          tables.pair_b, tables.pair_next))))
  # (1, 2) -> 5, (2, 5) -> 1, (5, 1) -> 2; (0, 6) unseen -> the bigram of 6: 8, then (6, 8) -> 9.
  np.testing.assert_array_equal(drafts, [[5, 1, 2], [8, 9, 9]])


def test_ngram_drafts_are_exact_and_counted_once(tiny_workdir, tmp_path, monkeypatch):
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path))
  loaded = mtp.load(tiny_workdir)
  prompts = ['def add(a, b):\n    return', 'import os\n', 'class Point:\n    def __init__']
  ar = mtp.generate(loaded, prompts, max_new_tokens=16, decoder='autoregressive')
  for drafters in (['ngram'], ['heads', 'ngram', 'lookup']):
    out = mtp.generate(loaded, prompts, max_new_tokens=16, decoder='speculative',
                       drafters=drafters)
    assert [g.tokens for g in out] == [g.tokens for g in ar]
  assert len(list((measurements.root() / 'ngram_tables').glob('*.npy'))) == 1


def test_a_model_without_a_workdir_is_named():
  import pytest
  with pytest.raises(ValueError, match='n-gram drafts count the training corpus'):
    decode_testing.engine(testing.tiny_model(0), max_new_tokens=4, drafters=['ngram'])
