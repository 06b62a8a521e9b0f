"""Shape buckets: `mtp.generate` resolves a decoder per bucket, keeps it for the next call of
that bucket, and decodes the tokens a plan resolved for the call's exact shapes decodes."""

import types

import numpy as np
import pytest

import mtp
from mtp.decode import buckets
from mtp.decode import engine as engine_lib
from mtp.decode import plan as plan_lib
from mtp.decode import settings as settings_lib


def test_buckets_are_powers_of_two_within_the_models_positions():
  assert [buckets.bucket(n) for n in (1, 255, 256, 257, 600)] == [256, 256, 256, 512, 1024]
  assert buckets.plan_shapes(7, 64, 8192) == (256, 256)
  assert buckets.plan_shapes(422, 128, 8192) == (512, 256)
  assert buckets.plan_shapes(600, 300, 8192) == (1024, 512)
  # Never past the model's positions, never below the call's own shapes.
  assert buckets.plan_shapes(100, 20, 128) == (128, 128)
  assert buckets.plan_shapes(70, 20, 100) == (128, 100)
  assert buckets.plan_shapes(5000, 100, 6000) == (6016, 256)


class _Loaded:
  """What `buckets.engine` reads of a loaded model."""

  def __init__(self):
    self.model = types.SimpleNamespace(cfg=types.SimpleNamespace(
        trunk=types.SimpleNamespace(max_seq_len=8192)))
    self._engines = {}

  def engines(self):
    return self._engines


@pytest.fixture(name='resolved')
def _resolved(monkeypatch):
  """Every plan_lib.resolve call's arguments; each returns a fresh object."""
  calls = []

  def resolve(source, decoder, **kwargs):
    calls.append(dict(decoder=decoder, **kwargs))
    return object()
  monkeypatch.setattr(plan_lib, 'resolve', resolve)
  return calls


def test_an_engine_is_kept_per_decoder_options_and_bucket(resolved, monkeypatch):
  loaded = _Loaded()
  first, width, kept = buckets.engine(loaded, 'auto', prompt_width=30, max_new_tokens=64,
                                      batch_size=1, tree=[[0], [0, 0]])
  assert (width, kept) == (256, False)
  assert resolved[-1]['prompt_width'] == 256 and resolved[-1]['max_new_tokens'] == 256
  again, _, kept = buckets.engine(loaded, 'auto', prompt_width=200, max_new_tokens=100,
                                  batch_size=1, tree=[[0], [0, 0]])
  assert again is first and kept and len(resolved) == 1
  for other in (dict(decoder='speculative'), dict(prompt_width=300), dict(batch_size=2),
                dict(tree=[[0]]), dict(draft_vocab=np.arange(8))):
    call = dict(decoder='auto', prompt_width=30, max_new_tokens=64, batch_size=1,
                tree=[[0], [0, 0]]) | other
    engine, _, kept = buckets.engine(loaded, call.pop('decoder'), **call)
    assert engine is not first and not kept
  assert len(resolved) == 6
  # Equal id arrays are the same option.
  assert buckets.engine(loaded, 'auto', prompt_width=30, max_new_tokens=64, batch_size=1,
                        tree=[[0], [0, 0]], draft_vocab=np.arange(8))[2]
  # The oldest engine is dropped past MOST_KEPT.
  monkeypatch.setattr(buckets, 'MOST_KEPT', 2)
  buckets.engine(loaded, 'auto', prompt_width=30, max_new_tokens=700, batch_size=1)
  assert len(loaded.engines()) == 2
  assert not buckets.engine(loaded, 'auto', prompt_width=200, max_new_tokens=100,
                            batch_size=1, tree=[[0], [0, 0]])[2]


def test_exact_shapes_and_unmatchable_options_are_resolved_afresh(resolved):
  loaded = _Loaded()
  for _ in range(2):
    _, width, kept = buckets.engine(loaded, 'auto', prompt_width=30, max_new_tokens=64,
                                    capacity=200, calibration=(np.zeros((1, 30)), [30]))
    assert (width, kept) == (30, False)
    assert resolved[-1]['prompt_width'] == 30 and resolved[-1]['max_new_tokens'] == 64
    assert not buckets.engine(loaded, 'auto', prompt_width=30, max_new_tokens=64,
                              hook_data=np.zeros((2, 3)))[2]
  assert len(resolved) == 4 and not loaded.engines()


def test_calibration_prompts_are_padded_to_the_bucket(resolved):
  buckets.engine(_Loaded(), 'auto', prompt_width=30, max_new_tokens=8,
                 calibration=(np.ones((2, 30), np.int32), np.asarray([30, 12])))
  prompts, lengths = resolved[-1]['calibration']
  assert prompts.shape == (2, 256) and not prompts[:, 30:].any()
  assert list(lengths) == [30, 12]


def _exact(loaded, prompt: str, max_new_tokens: int, decoder: str) -> list[int]:
  """Greedy tokens of a plan resolved for this prompt's exact width and budget."""
  ids = loaded.tokenizer.encode(prompt)
  engine = plan_lib.resolve(loaded, decoder, max_new_tokens=max_new_tokens,
                            prompt_width=len(ids), greedy_only=True)
  sampling = settings_lib.Sampling(max_tokens=max_new_tokens, stop_ids=(
      () if loaded.tokenizer.eos_id is None else (loaded.tokenizer.eos_id,)))
  out = engine.generate(np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32),
                        engine.settings([sampling]))
  return [int(t) for t in out.tokens[0, :out.num_generated[0]]]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_generate_reuses_its_decoder_and_decodes_as_the_exact_plan(tiny_workdir, dtype):
  loaded = mtp.load(tiny_workdir, dtype=dtype)
  calls = [('def add(a, b):\n    return', 12), ('import os\n', 5),
           ('class Point:\n    def __init__(self, x, y):\n        self.x = x\n', 20)]
  for decoder in ('autoregressive', 'speculative'):
    first = mtp.generate(loaded, calls[0][0], max_new_tokens=calls[0][1], decoder=decoder)
    traced = engine_lib.COMPILATIONS.total()
    later = [mtp.generate(loaded, p, max_new_tokens=n, decoder=decoder) for p, n in calls[1:]]
    assert engine_lib.COMPILATIONS.total() == traced, 'a call of the same bucket compiled'
    for (prompt, n), [generation] in zip(calls, [first] + later):
      assert generation.tokens == _exact(loaded, prompt, n, decoder), (decoder, prompt)
      assert len(generation.tokens) <= n
