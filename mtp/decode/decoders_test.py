"""The decoder registry's defaults: lookup drafts and draft vocabularies."""

import pytest

from mtp.decode import decoders


def test_lookup_defaults_to_the_decoders_own_when_greedy_with_heads():
  assert decoders.default_lookup('auto', None, 0.0, 4) == 8
  assert decoders.default_lookup('auto', None, 0.7, 4) == 0  # Lookup is verified greedily only.
  assert decoders.default_lookup('auto', None, 0.0, 0) == 0
  assert decoders.default_lookup('speculative', None, 0.0, 4) == 0
  assert decoders.default_lookup('speculative', 5, 0.0, 4) == 5  # Named: kept.


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
  # A named size (0 = the whole vocabulary) is the caller's: kept, and checked by the request.
  assert decoders.default_draft_vocab('auto', 0, 49152, 4) == 0
  assert decoders.default_draft_vocab('speculative', 1024, 49152, 4) == 1024


def test_an_unknown_decoder_is_named():
  with pytest.raises(ValueError, match='decoder must be one of auto, speculative, '
                                       'autoregressive'):
    decoders.default_draft_vocab('medusa', None, 49152, 4)
