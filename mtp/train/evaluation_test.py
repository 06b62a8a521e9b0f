"""Evaluation helpers against a direct computation."""

import jax
import numpy as np

from mtp.data import pipeline
from mtp.data import tokenizer as tokenizer_lib
from mtp.model import testing
from mtp.train import evaluation


def test_loss_by_position_matches_the_loss_computed_row_by_row():
  tokenizer = tokenizer_lib.byte_tokenizer()
  model = testing.tiny_model(0, vocab_size=tokenizer.vocab_size)
  texts = ['def f(x):\n    return x + 1\n' * 6, 'short one\n', 'class A:\n    pass\n' * 4]
  seq_len, edges = 48, (0, 10, 30, 48)
  got = evaluation.loss_by_position(model, tokenizer, texts, seq_len, edges, batch_size=2,
                                     max_batches=100)

  arrays = pipeline.pack(pipeline.tokenize_documents(texts, tokenizer), seq_len,
                         pad_id=tokenizer.pad_id)
  sums, counts = np.zeros(3), np.zeros(3)
  for row in range(arrays['tokens'].shape[0]):
    tokens, positions, segments = (arrays[k][row:row + 1] for k in
                                   ('tokens', 'positions', 'segment_ids'))
    log_probs = np.asarray(jax.nn.log_softmax(model.logits(model(tokens, positions, segments)[0])))
    for t in range(seq_len - 1):
      if segments[0, t + 1] == 0 or segments[0, t + 1] != segments[0, t]:
        continue
      bucket = np.searchsorted(edges, positions[0, t], side='right') - 1
      sums[bucket] -= log_probs[0, t, tokens[0, t + 1]]
      counts[bucket] += 1
  assert [b['tokens'] for b in got] == counts.astype(int).tolist()
  np.testing.assert_allclose([b['ntp_loss'] for b in got], sums / counts, rtol=1e-5)
  assert [(b['start'], b['end']) for b in got] == [(0, 10), (10, 30), (30, 48)]


def test_heads_are_scored_over_their_draft_vocabulary_with_labels_outside_it_as_misses():
  tokenizer = tokenizer_lib.byte_tokenizer()
  model = testing.tiny_model(0, vocab_size=tokenizer.vocab_size)
  texts = ['def f(x):\n    return x + 1\n' * 6, 'class A:\n    pass\n' * 4]
  seq_len = 48
  everything = evaluation.evaluate_texts(model, tokenizer, texts, seq_len)
  in_order = evaluation.evaluate_texts(model, tokenizer, texts, seq_len,
                                       draft_ids=np.arange(tokenizer.vocab_size))
  np.testing.assert_allclose([in_order[k] for k in sorted(everything)],
                             [everything[k] for k in sorted(everything)], rtol=1e-5)

  draft_ids = np.asarray([ord(c) for c in 'def (x):\n r+1'], np.int32)  # No 'u', 'n', ...
  got = evaluation.evaluate_texts(model, tokenizer, texts, seq_len, draft_ids=draft_ids)
  arrays = pipeline.pack(pipeline.tokenize_documents(texts, tokenizer), seq_len,
                         pad_id=tokenizer.pad_id)
  hidden = model(arrays['tokens'], arrays['positions'], arrays['segment_ids'])
  tokens, segments = arrays['tokens'], arrays['segment_ids']
  for k in range(1, model.mtp_num_heads + 1):  # Head k at t drafts token t + 1 + k.
    logits = np.asarray(model.logits(hidden[k]))[..., draft_ids]
    drafts = draft_ids[np.argmax(logits, axis=-1)]
    labels, same = tokens[:, 1 + k:], segments[:, 1 + k:] == segments[:, :-1 - k]
    valid = same & (segments[:, 1 + k:] != 0)
    want = (drafts[:, :-1 - k] == labels)[valid].mean()
    np.testing.assert_allclose(got[f'head_{k}_acc'], want, rtol=1e-6)
  assert got['ntp_loss'] == everything['ntp_loss']  # The trunk keeps its whole vocabulary.
