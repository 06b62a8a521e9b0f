"""Heads trained on cached frozen-trunk states, and self-distillation targets."""

import fcntl

import jax
import numpy as np
import pytest

import mtp
from mtp.decode import testing as decode_testing
from mtp.train import trainer as trainer_lib
from mtp.train import trainer_test
from mtp.train import trunk_cache
from mtp.train import writers


@pytest.fixture(scope='module')
def trained_workdir(tiny_workdir):
  """The session's tiny workdir: heads trained on its frozen trunk only read it."""
  return tiny_workdir


def test_targets_put_the_trunks_prediction_at_t_plus_1():
  tokens = np.array([[5, 6, 7, 8]], np.int32)
  predictions = np.array([[16, 17, 18, 19]], np.int32)  # the trunk's next token at t = 0..3
  np.testing.assert_array_equal(trunk_cache.targets_from_predictions(tokens, predictions),
                                [[5, 16, 17, 18]])


def _heads_config(source, **overrides):
  return trainer_test._config(**{
      'init_from': str(source), 'optim.mode': 'frozen_trunk', 'model.mtp_num_heads': 2,
      'num_train_steps': 3, 'log_every_steps': 1, 'eval_steps': 0,
      'data.max_corpus_bytes': 60_000, **overrides})


def _losses(workdir):
  return [(m['loss'], m['head_1_loss'], m['head_2_loss'])
          for m in writers.read_metrics(workdir) if 'loss' in m]


@pytest.mark.parametrize('head_type, stored', [
    ('medusa', ['targets.npy', 'trunk_hidden.npy']),
    ('sequential', ['targets.npy', 'trunk_hidden.npy']),
    # Streams run the trunk's top layers on their own tokens: their inputs are kept too.
    ('streaming', ['targets.npy', 'trunk_hidden.npy', 'trunk_layer_inputs.npy'])])
def test_cached_trunk_states_train_the_heads_as_the_trunk_would(trained_workdir, tmp_path,
                                                                 head_type, stored):
  """Caching is an optimisation only: the same steps give the same losses."""
  plain = _heads_config(trained_workdir, **{'model.mtp_head_type': head_type})
  cached = _heads_config(trained_workdir, **{'model.mtp_head_type': head_type,
                                             'distill.cache_trunk_states': True})
  trainer_lib.train_and_evaluate(plain, tmp_path / 'plain')
  trainer_lib.train_and_evaluate(cached, tmp_path / 'cached')
  np.testing.assert_allclose(_losses(tmp_path / 'cached'), _losses(tmp_path / 'plain'),
                             rtol=2e-5)
  [directory] = (tmp_path / 'cached' / 'trunk_cache').iterdir()
  assert sorted(p.name for p in directory.iterdir()) == stored


def test_soft_labels_train_alike_on_cached_and_live_trunk_states(trained_workdir, tmp_path):
  """EAGLE-3's drafter on the trunk's distributions: the cache changes nothing, and the
  targets are not the label tokens."""
  eagle3 = {'model.mtp_head_type': 'eagle', 'model.eagle_features': 'fused',
            'model.eagle_input': 'concat', 'model.eagle_feature_loss_weight': 0.0,
            'distill.targets': 'teacher'}
  runs = {'live': {'distill.soft_labels': True}, 'hard': {'distill.cache_trunk_states': True},
          'cached': {'distill.soft_labels': True, 'distill.cache_trunk_states': True}}
  for name, overrides in runs.items():
    trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **eagle3, **overrides),
                                   tmp_path / name)
  cached, live = _losses(tmp_path / 'cached'), _losses(tmp_path / 'live')
  np.testing.assert_allclose(cached, live, rtol=2e-5)
  hard = _losses(tmp_path / 'hard')
  assert not np.allclose(cached[0], hard[0], rtol=1e-3)


def test_heads_trained_on_a_draft_vocabulary_draft_over_it(trained_workdir, tmp_path,
                                                           monkeypatch):
  """mtp_head_draft_vocab: training counts the corpus as decoding does, so decoding's default
  draft vocabulary is the trained one, and greedy output stays the trunk's."""
  from mtp.decode import draft_vocab  # pylint: disable=import-outside-toplevel
  from mtp.decode import plan  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  workdir = tmp_path / 'heads'
  trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **{
      'mtp_head_draft_vocab': 48, 'distill.targets': 'teacher', 'distill.soft_labels': True,
      'distill.cache_trunk_states': True}), workdir)
  loaded = mtp.load(workdir)
  resolved = plan.resolve(loaded, 'speculative', max_new_tokens=8)
  assert resolved.plan.draft_vocab_size == 48
  assert plan.resolve(loaded, 'speculative', max_new_tokens=8,
                      draft_vocab=0).plan.draft_vocab_size == 0
  ids = draft_vocab.draft_vocabulary(loaded, 48)
  assert len(set(ids.tolist())) == 48
  prompts = ['def f(x):\n    return', 'import os\n']
  drafted = mtp.generate(loaded, prompts, max_new_tokens=8, decoder='speculative')
  plain = mtp.generate(loaded, prompts, max_new_tokens=8, decoder='autoregressive')
  assert [g.tokens for g in drafted] == [g.tokens for g in plain]
  with pytest.raises(ValueError, match=r'mtp_head_draft_vocab must be an integer in \[1, '):
    trainer_lib.train_and_evaluate(_heads_config(trained_workdir, mtp_head_draft_vocab=10**6),
                                   tmp_path / 'too_large')


def test_teacher_targets_are_the_trunks_own_greedy_tokens(trained_workdir, tmp_path):
  config = _heads_config(trained_workdir, **{'distill.targets': 'teacher',
                                             'distill.cache_trunk_states': True})
  metrics = trainer_lib.train_and_evaluate(config, tmp_path)
  assert 'ntp_loss' not in metrics and metrics['acceptance_proxy'] >= 0  # trunk loss skipped
  [directory] = (tmp_path / 'trunk_cache').iterdir()
  targets = np.load(directory / 'targets.npy')
  [split] = (tmp_path / 'data_cache').glob('train-*.npz')
  rows = dict(np.load(split))
  source = mtp.load(trained_workdir).model
  normed = source(rows['tokens'][:4], rows['positions'][:4], rows['segment_ids'][:4])[0]
  greedy = np.argmax(np.asarray(source.logits(normed)), axis=-1)
  np.testing.assert_array_equal(targets[:4, 1:], greedy[:, :-1])
  # A resumed or repeated run reuses the cache rather than running the trunk again.
  before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
  config.num_train_steps = 4
  trainer_lib.train_and_evaluate(config, tmp_path)
  assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before


def test_a_bfloat16_pass_gives_the_bfloat16_trunks_greedy_tokens(trained_workdir, tmp_path):
  """`distill.dtype`: the pass (a float32 model's) runs in bfloat16, under its own cache key."""
  config = _heads_config(trained_workdir, **{'distill.targets': 'teacher',
                                             'distill.cache_trunk_states': True,
                                             'distill.dtype': 'bfloat16'})
  trainer_lib.train_and_evaluate(config, tmp_path / 'bf16')
  [directory] = (tmp_path / 'bf16' / 'trunk_cache').iterdir()
  targets = np.load(directory / 'targets.npy')
  [split] = (tmp_path / 'bf16' / 'data_cache').glob('train-*.npz')
  rows = dict(np.load(split))
  source = mtp.load(trained_workdir, dtype='bfloat16').model
  normed = source(rows['tokens'][:4], rows['positions'][:4], rows['segment_ids'][:4])[0]
  greedy = np.argmax(np.asarray(source.logits(normed), np.float32), axis=-1)
  # Only near-ties may differ: bfloat16 sums depend on the batch's shape (the pass pads to 8).
  assert np.mean(targets[:4, 1:] == greedy[:, :-1]) >= 0.97
  config.distill.dtype = 'model'  # float32: another pass, in another cache.
  trainer_lib.train_and_evaluate(config, tmp_path / 'f32')
  [f32] = (tmp_path / 'f32' / 'trunk_cache').iterdir()
  assert f32.name != directory.name
  hidden, hidden_bf16 = (np.load(d / 'trunk_hidden.npy') for d in (f32, directory))
  assert 0 < np.abs(hidden - hidden_bf16).max() < 0.1 * np.abs(hidden).max()


def test_teacher_targets_also_guide_a_finetuned_trunk(trained_workdir, tmp_path):
  """Medusa-2 with self-distillation: only the targets are cached, the trunk trains."""
  config = _heads_config(trained_workdir, **{'distill.targets': 'teacher',
                                             'optim.mode': 'finetune'})
  trainer_lib.train_and_evaluate(config, tmp_path)
  [directory] = (tmp_path / 'trunk_cache').iterdir()
  assert [p.name for p in directory.iterdir()] == ['targets.npy']


def test_rollout_prompts_lie_in_one_document():
  tokens = np.arange(24, dtype=np.int32).reshape(3, 8)
  segments = np.array([[1, 1, 2, 2, 2, 2, 3, 3],    # first window of 3: tokens 2..4
                       [1, 2, 3, 4, 5, 6, 7, 7],    # no document of 3 tokens
                       [1, 1, 1, 1, 0, 0, 0, 0]])   # padding is no document
  prompts = trunk_cache.rollout_prompts({'tokens': tokens, 'segment_ids': segments}, 3)
  np.testing.assert_array_equal(prompts, [[2, 3, 4], [16, 17, 18]])
  with pytest.raises(ValueError, match='distill.prompt_len must be in'):
    trunk_cache.rollout_prompts({'tokens': tokens, 'segment_ids': segments}, 8)


def test_rollout_rows_are_the_trunks_greedy_continuations(trained_workdir, tmp_path):
  """Rows = prompt + the trunk's greedy continuation; its hidden states are the trunk's own."""
  prompt_len = 6
  config = _heads_config(trained_workdir, **{
      'distill.targets': 'rollout', 'distill.cache_trunk_states': True,
      'distill.prompt_len': prompt_len, 'eval_steps': 1, 'model.mtp_head_type': 'streaming',
      'model.streaming_layers': 1})
  metrics = trainer_lib.train_and_evaluate(config, tmp_path)
  assert 'ntp_loss' not in metrics and 'eval_head_1_acc' in metrics
  [split] = (tmp_path / 'data_cache').glob('train-*.npz')
  prompts = trunk_cache.rollout_prompts(dict(np.load(split)), prompt_len)
  [rows] = [trunk_cache.load(d, ['tokens', 'positions', 'targets', 'head_mask', 'trunk_hidden',
                                  'trunk_layer_inputs'])
            for d in (tmp_path / 'trunk_cache').iterdir()
            if np.load(d / 'tokens.npy').shape[0] == len(prompts)]  # not the eval rows
  seq_len = config.data.seq_len
  assert rows['tokens'].shape == (len(prompts), seq_len)
  np.testing.assert_array_equal(rows['tokens'][:, :prompt_len], prompts)
  source = mtp.load(trained_workdir).model
  greedy = decode_testing.decode(source, prompts[:4], decoder='autoregressive',
                                 max_new_tokens=seq_len - prompt_len)
  np.testing.assert_array_equal(rows['tokens'][:4, prompt_len:], greedy.tokens)
  # On the continuation the trunk's next token is the row's next token.
  np.testing.assert_array_equal(rows['targets'][:, prompt_len:], rows['tokens'][:, prompt_len:])
  last = source.cfg.trunk.num_layers - 1  # The streamed layer's input is kept too.
  hidden, inputs = source.trunk.train_forward(rows['tokens'][:4], rows['positions'][:4],
                                              np.ones((4, seq_len), np.int32), [last])
  np.testing.assert_allclose(rows['trunk_hidden'][:4], hidden, atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(rows['trunk_layer_inputs'][:4, :, 0], inputs[last], atol=2e-4,
                             rtol=2e-4)
  np.testing.assert_array_equal(rows['head_mask'][0], np.arange(seq_len) >= prompt_len - 1)


@pytest.mark.parametrize('overrides, message', [
    ({'distill.targets': 'teacher', 'init_from': ''}, 'needs init_from'),
    ({'distill.targets': 'labels'}, 'distill.targets must be one of'),
    ({'distill.targets': 'rollout', 'distill.prompt_len': 0}, 'distill.prompt_len must be in'),
    ({'distill.targets': 'rollout', 'distill.prompt_len': 64}, 'distill.prompt_len must be in'),
    ({'distill.cache_trunk_states': True, 'optim.mode': 'finetune'},
     "only a frozen trunk's states can be reused"),
    ({'distill.batch_size': 0}, 'distill.batch_size must be positive'),
    ({'distill.dtype': 'float16'}, 'distill.dtype must be one of'),
    ({'distill.soft_labels': True, 'optim.mode': 'finetune'},
     'the frozen pretrained trunk is the teacher'),
    ({'distill.soft_labels': True, 'model.mtp_num_heads': 0}, 'model.mtp_num_heads is 0'),
])
def test_bad_distill_settings_are_named(trained_workdir, tmp_path, overrides, message):
  config = _heads_config(trained_workdir, **overrides)
  with pytest.raises(ValueError, match=message):
    trainer_lib.train_and_evaluate(config, tmp_path / 'new')
  assert not (tmp_path / 'new').exists()


class _Interrupted(Exception):
  pass


def _fake_trunk(calls: list, fail_at: int | None = None):
  """A trunk pass whose states are a function of the row's tokens; raises on call `fail_at`."""
  def forward(tokens, positions, segment_ids):
    del positions, segment_ids
    calls.append(tokens[:, 0].copy())
    if fail_at is not None and len(calls) == fail_at:
      raise _Interrupted
    hidden = np.repeat(tokens[..., None].astype(np.float32), 3, axis=-1)
    return hidden, np.stack([hidden, -hidden], axis=2), (tokens + 1).astype(np.int32)
  return forward


def _rows(n: int, t: int = 5) -> dict[str, np.ndarray]:
  tokens = np.arange(n * t, dtype=np.int32).reshape(n, t)
  return {'tokens': tokens, 'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)),
          'segment_ids': np.ones((n, t), np.int32)}


def test_an_interrupted_trunk_pass_resumes_where_it_stopped(tmp_path):
  arrays, kwargs = _rows(10), dict(batch_size=3, store_hidden=True, store_layer_inputs=True)
  expected = trunk_cache.build(arrays, _fake_trunk([]), tmp_path / 'whole', **kwargs)
  first = []
  with pytest.raises(_Interrupted):  # Stopped in its third batch: rows 0..5 are on disk.
    trunk_cache.build(arrays, _fake_trunk(first, fail_at=3), tmp_path / 'key', **kwargs)
  assert not (tmp_path / 'key').exists() and (tmp_path / 'key.partial').is_dir()
  resumed = []
  cached = trunk_cache.build(arrays, _fake_trunk(resumed), tmp_path / 'key', **kwargs)
  assert len(resumed) == 2  # Rows 6..8 and 9 (padded): none of the six on disk again.
  np.testing.assert_array_equal(np.concatenate(resumed)[:4], arrays['tokens'][6:, 0])
  assert cached.keys() == expected.keys()
  for name in expected:
    np.testing.assert_array_equal(cached[name], expected[name])
  assert sorted(p.name for p in tmp_path.iterdir()) == ['key', 'whole']  # Nothing left over.
  assert not (tmp_path / 'key' / 'progress.json').exists()


@pytest.mark.parametrize('seconds, text', [
    (0, ''), (-3, ''), (42.4, ', about 42 s left'), (600, ', about 10 minutes left'),
    (3 * 3600, ', about 3.0 hours left')])
def test_time_left_reads_in_the_unit_a_person_would_say(seconds, text):
  assert trunk_cache.time_left(seconds) == text


def test_a_pass_logs_its_rate_and_the_time_left(tmp_path, caplog):
  caplog.set_level('INFO')
  trunk_cache.build(_rows(10), _fake_trunk([]), tmp_path / 'key', batch_size=3,
                    store_hidden=True)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Trunk pass:')]
  assert lines[0].startswith('Trunk pass: 3/10 rows (') and 'left).' in lines[0]
  assert lines[-1].startswith('Trunk pass: 10/10 rows (') and 'tokens/s).' in lines[-1]


def test_a_partial_pass_over_other_rows_is_built_again(tmp_path):
  kwargs = dict(batch_size=3, store_hidden=True)
  with pytest.raises(_Interrupted):
    trunk_cache.build(_rows(10), _fake_trunk([], fail_at=2), tmp_path / 'key', **kwargs)
  calls = []
  cached = trunk_cache.build(_rows(7), _fake_trunk(calls), tmp_path / 'key', **kwargs)
  assert len(calls) == 3 and cached[trunk_cache.HIDDEN].shape == (7, 5, 3)
  np.testing.assert_array_equal(cached[trunk_cache.HIDDEN][:, :, 0], _rows(7)['tokens'])


def test_a_pass_already_owned_by_another_process_builds_a_private_copy(tmp_path):
  arrays, kwargs = _rows(4), dict(batch_size=3, store_hidden=False)
  with open(tmp_path / 'key.partial.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # As another process building the same key would.
    # flock is per open file description: this process's second open is refused as another's.
    with pytest.raises(_Interrupted):
      trunk_cache.build(arrays, _fake_trunk([], fail_at=2), tmp_path / 'key', **kwargs)
    assert not list(tmp_path.glob('*.tmp'))  # A private copy is not kept for resuming.
    cached = trunk_cache.build(arrays, _fake_trunk([]), tmp_path / 'key', **kwargs)
  np.testing.assert_array_equal(cached[trunk_cache.TARGETS][:, 1:], arrays['tokens'][:, :-1] + 1)
  assert not (tmp_path / 'key.partial').exists()


def _heads_of(workdir):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from mtp.checkpoint import param_tree  # pylint: disable=import-outside-toplevel
  state = nnx.state(mtp.load(workdir).model, nnx.Param)
  return nnx.to_pure_dict(param_tree.select(state, [param_tree.HEADS]))


def test_heads_start_from_another_workdirs_heads_and_draft_vocabulary(trained_workdir, tmp_path,
                                                                      monkeypatch):
  """init_heads_from: a fresh run trains on from another run's heads (and their ids), e.g. a
  fine-tune on rollouts after teacher-forced features; a misfit is named before any work."""
  monkeypatch.setenv('MTP_CACHE_DIR', str(tmp_path / 'cache'))
  first = tmp_path / 'first'
  settings = {'mtp_head_draft_vocab': 40, 'distill.targets': 'teacher',
              'distill.cache_trunk_states': True}
  trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **settings), first)
  # Rollout targets and a rate too small to move them: the second run's heads are the first's.
  second = tmp_path / 'second'
  trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **{
      **settings, 'distill.targets': 'rollout', 'init_heads_from': str(first),
      'num_train_steps': 1, 'optim.learning_rate': 1e-12, 'optim.warmup_steps': 0}), second)
  started, trained = jax.tree.leaves(_heads_of(second)), jax.tree.leaves(_heads_of(first))
  assert len(started) == len(trained) > 0
  for a, b in zip(started, trained):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert (second / 'draft_vocab.json').read_text() == (first / 'draft_vocab.json').read_text()
  # Fresh heads would not be the first run's.
  fresh = tmp_path / 'fresh'
  trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **{
      **settings, 'num_train_steps': 1, 'optim.learning_rate': 1e-12}), fresh)
  assert any(not np.allclose(a, b, atol=1e-3)
             for a, b in zip(jax.tree.leaves(_heads_of(fresh)), trained))

  for overrides, message in [
      ({'model.mtp_num_heads': 3}, r'model.mtp_num_heads: 2 there, 3 configured'),
      ({'model.mtp_head_type': 'sequential'}, r"model.mtp_head_type: 'medusa' there"),
      ({'mtp_head_draft_vocab': 0}, r'mtp_head_draft_vocab: 40 there, 0 configured'),
  ]:
    misfit = tmp_path / 'misfit'
    with pytest.raises(ValueError, match=message):
      trainer_lib.train_and_evaluate(_heads_config(trained_workdir, **{
          **settings, 'init_heads_from': str(first), **overrides}), misfit)
    assert not (misfit / 'config.json').exists()  # Refused before anything was written.
