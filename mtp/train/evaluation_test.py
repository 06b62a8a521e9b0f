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
