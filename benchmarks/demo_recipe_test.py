"""The recipe benchmark's measures of a completion and of a run's time."""

import ml_collections

from benchmarks import demo_recipe


def test_completion_stats_count_whitespace_blank_completions_and_repeats():
  stats = demo_recipe.completion_stats(['\n\n\n', 'x = 1\nx = 1\ny = 2\n'])
  assert stats['blank_completions'] == 0.5
  assert stats['repeated_line_fraction'] == 1 - 2 / 3
  assert stats['whitespace_fraction'] == (3 + 9) / (3 + 18)


def test_still_tokenizes_allows_a_cut_but_not_a_broken_indent():
  assert demo_recipe.still_tokenizes('def f(x):\n    return (x +\n')  # Cut inside brackets.
  assert demo_recipe.still_tokenizes('s = """an unfinished\nstring')
  assert not demo_recipe.still_tokenizes('if x:\n        a = 1\n    b = 2\nc = 3\n')


def test_training_seconds_add_up_the_logged_intervals_of_both_phases():
  config = ml_collections.ConfigDict({
      'num_train_steps': 40, 'data': {'batch_size': 2, 'seq_len': 50},
      'long_context': {'steps': 10, 'seq_len': 100, 'batch_size': 3}})
  records = [{'step': 10, 'tokens_per_sec': 1000.0}, {'step': 10, 'eval_ntp_loss': 1.0},
             {'step': 30, 'tokens_per_sec': 500.0}, {'step': 40, 'tokens_per_sec': 600.0}]
  assert demo_recipe.training_seconds(records, config) == (
      10 * 100 / 1000 + 20 * 100 / 500 + 10 * 300 / 600)
