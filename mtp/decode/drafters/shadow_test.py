"""The shadow check of a chain against the text the rows emitted."""

import jax.numpy as jnp
import numpy as np

from mtp.decode.drafters import shadow


def _step(s, emitted, num, drafts, ready):
  return shadow.update(s, jnp.asarray(emitted), jnp.asarray(num), jnp.asarray(drafts),
                       jnp.asarray(ready))


def test_a_chain_matched_by_one_token_steps_counts_its_matches_plus_one():
  s = shadow.start(jnp.asarray([[5, 6, 7]]), jnp.asarray([True]))
  s = _step(s, [[5]], [1], [[9, 9, 9]], [True])
  s = _step(s, [[6]], [1], [[9, 9, 9]], [True])
  assert int(s.matched[0]) == 2 and np.isnan(float(s.mean[0]))
  s = _step(s, [[4]], [1], [[1, 2, 3]], [True])  # Differs: 2 drafts would have passed, + 1.
  assert float(s.mean[0]) == 3.0
  assert int(s.matched[0]) == 0 and list(np.asarray(s.drafts[0])) == [1, 2, 3]


def test_a_whole_chain_counts_its_length_plus_one_and_averages_move():
  s = shadow.start(jnp.asarray([[5, 6]]), jnp.asarray([True]))
  s = _step(s, [[5, 6, 8]], [3], [[1, 1]], [True])  # A verified step that took them all.
  assert float(s.mean[0]) == 3.0
  s = _step(s, [[2, 0, 0]], [1], [[1, 1]], [True])  # The next chain fails at once: 1 token.
  assert float(s.mean[0]) == (1 - shadow.WEIGHT) * 3.0 + shadow.WEIGHT * 1.0


def test_rows_not_ready_check_nothing_and_emitted_padding_is_ignored():
  s = shadow.start(jnp.asarray([[5, 6], [5, 6]]), jnp.asarray([False, True]))
  assert list(np.asarray(s.matched)) == [-1, 0]
  # Row 1 emits one token (its padding repeats the draft: it must not count).
  s = _step(s, [[5, 6], [5, 6]], [2, 1], [[3, 3], [3, 3]], [True, False])
  assert np.isnan(float(s.mean[0])) and list(np.asarray(s.matched)) == [0, 1]


def test_evidence_counts_the_chain_being_checked_as_ending_now():
  s = shadow.start(jnp.asarray([[5, 6, 7, 8]]), jnp.asarray([True]))
  assert np.isnan(float(shadow.evidence(s)[0]))
  s = _step(s, [[5]], [1], [[0, 0, 0, 0]], [True])
  s = _step(s, [[6]], [1], [[0, 0, 0, 0]], [True])
  assert float(shadow.evidence(s)[0]) == 3.0  # 2 matched so far: at least 3 tokens.
  s = _step(s, [[1]], [1], [[0, 0, 0, 0]], [True])  # It ended there.
  assert float(shadow.evidence(s)[0]) == float(s.mean[0]) == 3.0
