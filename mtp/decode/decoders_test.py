"""The decoder registry and the decode plan: which drafters each decoder mixes, the tree names,
and the rules every caller shares (prompt widths, the room for tokens)."""

import numpy as np
import pytest

from mtp.decode import decoders
from mtp.decode import plan
from mtp.decode import testing as decode_testing
from mtp.decode import trees
from mtp.model import testing


def _drafters(model, decoder, **options):
  engine = decode_testing.engine(model, decoder, max_new_tokens=4, **options)
  return [type(d).__name__ for d in engine.plan.drafters]


def test_each_decoder_mixes_its_own_drafters():
  heads, bare = testing.tiny_model(0), testing.tiny_model(0, mtp_num_heads=0)
  assert _drafters(heads, 'auto', tree=2) == ['HeadsDrafter', 'LookupDrafter']
  assert _drafters(heads, 'speculative') == ['HeadsDrafter']
  assert _drafters(heads, 'autoregressive') == []
  # A model without heads drafts by prompt lookup alone.
  assert _drafters(bare, 'auto') == ['LookupDrafter']
  assert _drafters(bare, 'speculative') == ['LookupDrafter']
  # lookup=0 takes prompt lookup out, lookup=N puts it in; a dynamic tree is a drafter too.
  assert _drafters(heads, 'auto', tree=2, lookup=0) == ['HeadsDrafter']
  assert _drafters(heads, 'speculative', lookup=3) == ['HeadsDrafter', 'LookupDrafter']
  assert _drafters(heads, 'speculative', tree_budget=3) == ['DynamicHeadsDrafter']
  # Named drafters, in the order given (the heads first).
  assert _drafters(heads, 'speculative', drafters=['lookup', 'heads']) == [
      'HeadsDrafter', 'LookupDrafter']
  with pytest.raises(ValueError, match='drafters must be distinct names of heads, lookup'):
    _drafters(heads, 'speculative', drafters=['beam'])


def test_a_block_hangs_each_drafters_nodes_below_the_root():
  engine = decode_testing.engine(testing.tiny_model(0), 'auto', max_new_tokens=4,
                                 tree=[(0,), (1,), (0, 0)], lookup=2)
  block, owner = engine.plan.block(2)
  np.testing.assert_array_equal(block.parent, [-1, 0, 0, 1, 0, 4])
  np.testing.assert_array_equal(owner, [-1, 0, 0, 0, 1, 1])
  assert engine.plan.block(1)[0].num_nodes == 4 and engine.plan.depth == 2
  assert engine.plan.block_size == 6


def test_the_tree_names_are_one_registry_read_by_one_parser():
  assert tuple(trees.NAMES) == ('chain', 'default', 'auto', 'dynamic')
  assert trees.parse(None) is None and trees.parse('dynamic') == 'dynamic'
  assert trees.parse('[[0], [0, 1]]') == [(0,), (0, 1)]
  with pytest.raises(ValueError, match='tree must be one of chain, default, auto, dynamic'):
    trees.parse('bushy')
  assert trees.static_tree('chain', 3) == trees.chain_tree(3)
  assert trees.static_tree('default', 2) == trees.medusa_default_tree(2)
  with pytest.raises(ValueError, match='measurements'):
    trees.static_tree('auto', 3)
  # The API takes the flag's text too: `mtp.generate(..., tree='[[0], [0, 0]]')`.
  assert trees.static_tree('[[0], [0, 0]]', 2) == trees.chain_tree(2)
  with pytest.raises(ValueError, match='JSON choices'):
    trees.static_tree('bushy', 2)


def test_prompt_widths_and_room():
  assert [plan.padded_width(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
  plan.check_room([10, 20], 100, 120)
  with pytest.raises(ValueError, match=r'prompt length 20 \+ max_new_tokens 101 = 121 exceeds '
                                       r'the model position limit max_seq_len=120 \(prompt 1'):
    plan.check_room([10, 20], 101, 120)
  with pytest.raises(ValueError, match='prompt 0 is the longest'):
    plan.check_room([10, 20], np.array([111, 5]), 120)  # Per-row budgets.


def test_auto_drafts_over_8192_ids_of_large_vocabularies_only():
  size = decoders.get('auto').draft_vocab
  assert size == 8192
  assert decoders.default_draft_vocab('auto', None, 49152, 4) == 8192  # SmolLM2.
  assert decoders.default_draft_vocab('auto', None, decoders.LARGE_VOCAB_FACTOR * size, 4) == size
  assert decoders.default_draft_vocab('auto', None, decoders.LARGE_VOCAB_FACTOR * size - 1,
                                      4) == 0
  assert decoders.default_draft_vocab('auto', None, 4096, 4) == 0  # The demo model.
  assert decoders.default_draft_vocab('auto', None, 49152, 0) == 0  # No heads, no drafts.
  assert decoders.default_draft_vocab('speculative', None, 49152, 4) == 0
  assert decoders.default_draft_vocab('autoregressive', None, 49152, 4) == 0
  # A named size (0 = the whole vocabulary) is the caller's: kept, and checked by the plan.
  assert decoders.default_draft_vocab('auto', 0, 49152, 4) == 0
  assert decoders.default_draft_vocab('speculative', 1024, 49152, 4) == 1024


def test_an_unknown_decoder_is_named():
  with pytest.raises(ValueError, match='decoder must be one of auto, speculative, '
                                       'autoregressive'):
    decoders.default_draft_vocab('medusa', None, 49152, 4)
