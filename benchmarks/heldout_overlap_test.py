"""benchmarks.heldout_overlap: a corpus holding the held-out files is caught, others pass."""

import importlib.util

from absl import flags
from absl.testing import flagsaver

from benchmarks import heldout_overlap

FLAGS = flags.FLAGS


def test_windows_cover_the_text_and_count_what_occurs():
  assert heldout_overlap.windows('abcdefg', 3, 2) == ['abc', 'cde', 'efg']
  assert heldout_overlap.windows('ab', 3, 2) == ['ab']
  assert heldout_overlap.normalise(' a\n\n  b\tc ') == 'a b c'
  assert heldout_overlap.occurring('abc\n  defg', 'xx abc defg', 4, 3) == (2, 2)
  assert heldout_overlap.occurring('abcdefg', 'abcd', 4, 3) == (1, 2)


@flagsaver.flagsaver
def test_a_corpus_with_the_heldout_files_fails(tiny_workdir, tmp_path, capsys):
  absl_dir = importlib.util.find_spec('absl').submodule_search_locations[0]
  unrelated = tmp_path / 'unrelated'
  unrelated.mkdir()
  (unrelated / 'a.py').write_text('def f(x):\n  return x + 1\n')
  FLAGS.unparse_flags()
  FLAGS(['heldout_overlap', f'--tokenizer={tiny_workdir}', '--kinds=code', '--num_prompts=2',
         '--prompt_tokens=64'])
  for corpus, status in ((str(unrelated), 0), (f'{unrelated}+{absl_dir}', 1)):
    FLAGS.corpus = corpus
    assert heldout_overlap.main([]) == status, capsys.readouterr().out
