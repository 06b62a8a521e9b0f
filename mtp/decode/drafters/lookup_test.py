"""Prompt-lookup drafts copy what followed the latest earlier occurrence of the text's end."""

import numpy as np

from mtp.decode.drafters import lookup


def _propose(rows, ends, length, max_ngram=3):
  width = max(len(r) for r in rows)
  context = np.full((len(rows), width), 99, np.int32)  # 99: stale slots after a row's end.
  for i, row in enumerate(rows):
    context[i, :len(row)] = row
  return np.asarray(lookup.propose(context, np.asarray(ends), length, max_ngram)).tolist()


def test_copies_what_followed_the_earlier_occurrence():
  assert _propose([[1, 2, 3, 4, 1, 2, 3]], [6], 3) == [[4, 1, 2]]


def test_the_longest_key_wins_over_a_later_shorter_one():
  # Key (5, 1, 9) last occurred at 0 (then 7); key (9) alone last occurred at 5 (then 8).
  assert _propose([[5, 1, 9, 7, 2, 9, 8, 5, 1, 9]], [9], 1) == [[7]]


def test_of_several_occurrences_the_latest_is_copied():
  assert _propose([[1, 2, 3, 1, 2, 4, 1, 2]], [7], 1) == [[4]]


def test_a_repetition_continues_past_the_newest_token_with_its_period():
  assert _propose([[8, 3, 4, 3, 4, 3]], [5], 5) == [[4, 3, 4, 3, 4]]
  assert _propose([[6, 6, 6]], [2], 3) == [[6, 6, 6]]


def test_without_any_match_the_newest_token_is_repeated():
  assert _propose([[1, 2, 3, 4]], [3], 2) == [[4, 4]]


def test_tokens_after_the_row_end_are_ignored_and_rows_are_independent():
  rows = [[1, 2, 7, 1, 2, 9, 9, 9],   # ends at position 4 (token 2): the 9s are stale
          [4, 5, 4, 5, 6, 0, 0, 0]]   # ends at position 2 (token 4): key (4) occurred at 0
  assert _propose(rows, [4, 2], 2) == [[7, 1], [5, 4]]
  # Copying past the end repeats the period instead of reading the stale 9.
  assert _propose([[2, 3, 8, 3, 9]], [3], 3) == [[8, 3, 8]]


def test_the_key_length_is_that_of_the_longest_matching_key():
  context = np.array([[1, 2, 3, 9, 2, 3],    # (2, 3) occurred before, (9, 2, 3) did not
                      [5, 1, 2, 5, 1, 2],    # (5, 1, 2) occurred before
                      [1, 2, 3, 4, 5, 6]],   # nothing did
                     np.int32)
  drafts, key = lookup.propose_with_key(context, np.array([5, 5, 5]), 2)
  assert np.asarray(key).tolist() == [2, 3, 0]
  assert np.asarray(drafts).tolist() == [[9, 2], [5, 1], [6, 6]]
