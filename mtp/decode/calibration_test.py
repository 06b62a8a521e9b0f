"""Head accuracies for tree building: against a position-by-position count; code prompts."""

import jax.numpy as jnp
import numpy as np

from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import calibration
from mtp.model import testing


def _brute_force(model, tokens, starts, ends, top_k):
  """The same conditional accuracies, counted one position and head at a time."""
  b, t = tokens.shape
  out = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)))
  ranked = np.argsort(-np.asarray(model.logits(out)), axis=-1, kind='stable')[..., :top_k]
  hits = np.zeros((model.mtp_num_heads, top_k))
  counts = np.zeros(model.mtp_num_heads)
  for row in range(b):
    for p in range(starts[row] - 1, ends[row]):
      for d in range(1, model.mtp_num_heads + 1):
        if p + 1 + d >= ends[row]:
          break
        counts[d - 1] += 1
        candidates = list(ranked[d, row, p])
        target = tokens[row, p + 1 + d]
        if target in candidates:
          hits[d - 1, candidates.index(target)] += 1
        if candidates[0] != target:
          break  # Deeper heads count only after a right top-1 chain.
  return hits / np.maximum(counts, 1)[:, None]


def test_accuracies_match_a_position_by_position_count():
  model = testing.tiny_model(0, vocab_size=13)  # Small vocabulary: many hits at every rank.
  tokens = testing.random_tokens((3, 24), 13, seed=2)
  starts, ends = np.array([4, 1, 10]), np.array([24, 17, 20])
  got = calibration.head_accuracies(model, tokens, starts, ends, top_k=3)
  np.testing.assert_allclose(got, _brute_force(model, tokens, starts, ends, 3), atol=1e-12)
  assert got[0].sum() > 0


def test_calibrate_on_greedy_continuations_gives_accuracies_in_range():
  model = testing.tiny_model(0, vocab_size=13)
  acc = calibration.calibrate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=12, top_k=2)
  assert acc.shape == (3, 2)
  assert ((acc >= 0) & (acc <= 1)).all() and (acc.sum(1) <= 1 + 1e-9).all()


def test_code_prompts_skip_the_header_and_cut_at_a_line(tmp_path):
  tokenizer = tokenizer_lib.byte_tokenizer()
  body = ''.join(f'x{i} = {i}\n' for i in range(40))
  (tmp_path / 'a.py').write_text('# Licence\n#\n\n' + body)
  (tmp_path / 'b.py').write_text('short = 1\n')
  prompts = calibration.code_prompts(sorted(tmp_path.iterdir()), tokenizer, num_prompts=2,
                                     max_tokens=50, min_tokens=20)
  assert len(prompts) == 1  # b.py is too short.
  [prompt] = prompts
  assert body.startswith(prompt) and prompt.endswith('\n')
  assert 40 < len(tokenizer.encode(prompt)) <= 50


def test_code_prompts_keep_to_a_character_budget(tmp_path):
  tokenizer = tokenizer_lib.byte_tokenizer()
  body = ''.join(f'value_{i} = {i}\n' for i in range(200))
  (tmp_path / 'a.py').write_text(body)
  [prompt] = calibration.code_prompts([tmp_path / 'a.py'], tokenizer, num_prompts=1,
                                      max_tokens=10_000, min_tokens=1, max_chars=100)
  assert body.startswith(prompt) and prompt.endswith('\n')
  assert 100 - len('value_10 = 10\n') < len(prompt) <= 100
