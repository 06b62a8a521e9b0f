"""Fault injection (Hypothesis): training killed at random points, workdirs with corrupt files.

  * Kill points: a tiny training run (configs/tiny.py, a checkpoint every 2 steps) in a
    subprocess gets SIGKILL at a random point: a random time after start (the data cache and
    config.json being written), or a random delay after a chosen step's metrics line or
    checkpoint directory appears (Orbax mid-write). Resumed in this process to completion, its
    final parameters and every logged loss equal an uninterrupted run's, bit for bit.
  * Corrupt files: one file of a trained tiny workdir, or of a heads-only workdir trained on
    it (every file either holds: config.json, tokenizer.json, special_tokens.json,
    chat_template.jinja, base.json, metrics.jsonl, data_cache/*.npz and each file under
    checkpoints/<step>/), gets random bytes flipped, is truncated, emptied, overwritten or
    deleted. Then `mtp.load` (and, in fewer examples, a resumed training run) either succeeds
    with identical results (identical parameters, tokenizer, config) or raises an exception
    whose message names the file or a directory holding it inside the workdir. Never a crash,
    a hang (a watchdog ends the process) or a silently different result.
  * A corrupt measurement cache: the heads' accuracies behind tree='auto' are kept in
    `$MTP_CACHE_DIR/decode/head_accuracies.json`, outside the workdir. Whatever happens to that
    file, a generation measures again where it must and its output is unchanged: a cache is
    never an error.

Example counts: the `ci` profile (the default) runs a few examples per test, the same ones on
every run (derandomized: a stable, bounded CI); set `MTP_HYPOTHESIS_PROFILE=thorough` for about
ten times as many, drawn afresh each run:

  MTP_HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -n 0 tests/fault_injection_test.py
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st

import mtp
from mtp import testing as mtp_testing
from mtp.data import tokenizer as tokenizer_lib
from mtp.train import testing as train_testing
from mtp.train import trainer as trainer_lib
from mtp.train import writers

_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
# The explain phase (which lines only failing examples run) takes minutes here: left out.
_PHASES = [p for p in Phase if p != Phase.explain]
settings.register_profile('ci', max_examples=4, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile('thorough', max_examples=40, deadline=None, database=None,
                          phases=_PHASES, print_blob=True, suppress_health_check=_HEALTH)
_PROFILE = os.environ.get('MTP_HYPOTHESIS_PROFILE', 'ci')
settings.load_profile(_PROFILE)
_SCALE = {'ci': 1, 'thorough': 10}[_PROFILE]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def event(value: str) -> None:
  """hypothesis.event, ignored outside a Hypothesis test (the plain tests share helpers)."""
  try:
    _hypothesis_event(value)
  except InvalidArgument:
    pass


def _examples(n: int) -> int:
  return n * _SCALE


def _config(**overrides):
  return train_testing.tiny_config(**{'eval_steps': 0, **overrides})


def _flat_params(loaded) -> dict:
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(loaded.model))}


def _assert_same_params(got: dict, expected: dict):
  assert got.keys() == expected.keys()
  for path, value in expected.items():
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))


@contextlib.contextmanager
def _watchdog(seconds: float):
  """A hang dumps every thread's traceback and ends the process (a failure, not a stuck CI)."""
  faulthandler.dump_traceback_later(seconds, exit=True)
  try:
    yield
  finally:
    faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------------------
# Kill points.
# ------------------------------------------------------------------------------------------

_KILL_STEPS = 8
_KILL_OVERRIDES = {'num_train_steps': _KILL_STEPS, 'log_every_steps': 1,
                   'checkpoint_every_steps': 2}


def _losses(workdir) -> dict[int, list[float]]:
  losses: dict[int, list[float]] = {}
  for record in writers.read_metrics(workdir):
    if 'loss' in record:
      losses.setdefault(record['step'], []).append(record['loss'])
  return losses


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('uninterrupted')
  trainer_lib.train_and_evaluate(_config(**_KILL_OVERRIDES), workdir)
  return _flat_params(mtp.load(workdir)), _losses(workdir)


def _trigger_seen(workdir: pathlib.Path, trigger: str, step: int) -> bool:
  if trigger == 'metrics':
    try:
      return any(json.loads(line).get('step', 0) >= step
                 for line in (workdir / 'metrics.jsonl').read_text().splitlines()
                 if line.endswith('}'))
    except (OSError, ValueError):
      return False
  try:  # A checkpoint directory of `step` (Orbax's temporary one or the final one).
    names = os.listdir(workdir / 'checkpoints')
  except OSError:
    return False
  return any(n == str(step) or n.startswith(f'{step}.') for n in names)


@settings(max_examples=_examples(2) if _PROFILE == 'ci' else 12)
@given(trigger=st.sampled_from(['checkpoint', 'metrics', 'time']),
       step=st.sampled_from([2, 4, 6]), delay=st.floats(0, 0.4))
def test_sigkill_at_a_random_point_then_resume_is_exact(uninterrupted, tmp_path_factory,
                                                         trigger, step, delay):
  """SIGKILL anywhere (mid-checkpoint included), resume: the uninterrupted run's parameters."""
  workdir = tmp_path_factory.mktemp('killed')
  flags = [f'--config.{k}={v}' for k, v in _KILL_OVERRIDES.items()]
  flags += ['--config.mesh.data=1', '--config.eval_steps=0']
  env = mtp_testing.child_env(devices=8, PYTHONPATH=str(ROOT))
  log = workdir.with_name(workdir.name + '.log')  # Not a pipe: a full one would block the run.
  with open(log, 'wb') as out:
    process = subprocess.Popen(
        [sys.executable, '-m', 'launch.train', f'--config={ROOT / "configs/tiny.py"}',
         f'--workdir={workdir}', *flags], cwd=ROOT, env=env, stdout=out, stderr=out)
  start = time.monotonic()
  try:
    while process.poll() is None and time.monotonic() - start < 120:
      if trigger == 'time':
        fired = time.monotonic() - start >= 1 + 12 * delay  # 1 s to 6 s after start.
      else:
        fired = _trigger_seen(workdir, trigger, step)
      if fired:
        if trigger != 'time':
          time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        break
      time.sleep(0.002)
  finally:
    if process.poll() is None:
      process.kill()
    process.wait()
  killed = process.returncode == -signal.SIGKILL
  assert killed or process.returncode == 0, log.read_text(errors='replace')[-3000:]
  event(f'killed={killed}, trigger={trigger}')
  with _watchdog(300):
    trainer_lib.train_and_evaluate(_config(**_KILL_OVERRIDES), workdir)
  expected_params, expected_losses = uninterrupted
  _assert_same_params(_flat_params(mtp.load(workdir)), expected_params)
  got = _losses(workdir)
  assert sorted(got) == sorted(expected_losses)
  for s, losses in got.items():
    assert set(losses) == set(expected_losses[s]), (s, losses, expected_losses[s])


# ------------------------------------------------------------------------------------------
# Corrupt files.
# ------------------------------------------------------------------------------------------

_PROBE = 'def f(x):\n    return x + 1  # é€😀'
_PROMPTS = ['import os\nimport', 'class A:\n    def']
_CURVE = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0, 32: 6.0}


def _fake_accuracies(num_heads: int, top_k: int = 4) -> np.ndarray:
  return np.linspace(0.9, 0.1, num_heads * top_k).reshape(-1, top_k)


@pytest.fixture(scope='module')
def workdirs(tiny_workdir, tmp_path_factory):
  """root/base: a copy of the session's tiny workdir; root/heads: parallel heads trained on its
  frozen trunk."""
  root = tmp_path_factory.mktemp('pristine')
  shutil.copytree(tiny_workdir, root / 'base')
  trainer_lib.train_and_evaluate(
      _config(**{'init_from': str(root / 'base'), 'optim.mode': 'frozen_trunk',
                 'model.mtp_head_type': 'parallel', 'model.mtp_num_heads': 2,
                 'num_train_steps': 2}), root / 'heads')
  # The byte tokenizer's ids are the legacy defaults, which need no special_tokens.json; write
  # the file anyway, so that its corruption is tried too.
  (root / 'base' / tokenizer_lib.SPECIAL_IDS_FILENAME).write_text(
      tokenizer_lib.SpecialIds().to_json())
  expected = {}
  for name in ('base', 'heads'):
    loaded = mtp.load(root / name)
    expected[name] = dict(params=_flat_params(loaded), step=loaded.step,
                          config=loaded.config.to_dict(),
                          probe=loaded.tokenizer.encode(_PROBE),
                          tokenizer=(loaded.tokenizer.kind, loaded.tokenizer.vocab_size,
                                     loaded.tokenizer.special_ids))
  files = sorted(str(p.relative_to(root)) for p in root.rglob('*')
                 if p.is_file() and 'tensorboard' not in p.parts)
  return root, files, expected


_CORRUPTIONS = st.sampled_from(['flip', 'truncate', 'empty', 'garbage', 'delete', 'append'])


def _corrupt(path: pathlib.Path, kind: str, where: float, seed: int) -> bool:
  """Corrupts `path` in place; False if that left its bytes unchanged."""
  data = path.read_bytes()
  rng = np.random.default_rng(seed)
  if kind == 'delete':
    path.unlink()
    return True
  if kind == 'flip' and data:
    i = min(int(where * len(data)), len(data) - 1)
    new = data[:i] + bytes([data[i] ^ int(rng.integers(1, 256))]) + data[i + 1:]
  elif kind == 'truncate':
    new = data[:int(where * len(data))]
  elif kind == 'garbage':
    new = rng.integers(0, 256, len(data), dtype=np.uint8).tobytes()
  elif kind == 'append':
    new = data + rng.integers(0, 256, 1 + int(where * 64), dtype=np.uint8).tobytes()
  else:
    new = b''
  path.write_bytes(new)
  return new != data


def _names(error: BaseException, path: pathlib.Path, workdir: pathlib.Path) -> bool:
  """Whether the message names the file, or a directory holding it inside the workdir."""
  message = str(error)
  if str(path) in message or str(path.relative_to(workdir)) in message:
    return True
  return any(str(parent) in message for parent in path.parents
             if parent != workdir and workdir in parent.parents)


def _copy(workdirs, tmp_path_factory):
  root, files, expected = workdirs
  copy = tmp_path_factory.mktemp('corrupt') / 'root'
  shutil.copytree(root, copy)
  return copy, files, expected


def _still_valid_json(path: pathlib.Path) -> bool:
  """A .json file that still parses: an edit of a text file, not a detectable corruption."""
  try:
    json.loads(path.read_bytes())
  except (OSError, ValueError):
    return False
  return path.suffix == '.json'


def _check_load(name: str, copy: pathlib.Path, path: pathlib.Path, expected: dict):
  workdir = copy / name
  try:
    with _watchdog(120):
      loaded = mtp.load(workdir)
  except Exception as e:  # noqa: BLE001
    event('load failed')
    owner = copy / path.relative_to(copy).parts[0]
    assert _names(e, path, owner), f'{type(e).__name__} does not name {path}: {e}'
    return None
  event('load succeeded')
  if _still_valid_json(path):
    event('an edit that is still valid JSON: loaded as written')
    return loaded
  assert loaded.step == expected['step']
  assert loaded.config.to_dict() == expected['config']
  assert loaded.tokenizer.encode(_PROBE) == expected['probe']
  assert (loaded.tokenizer.kind, loaded.tokenizer.vocab_size,
          loaded.tokenizer.special_ids) == expected['tokenizer']
  _assert_same_params(_flat_params(loaded), expected['params'])
  return loaded


@settings(max_examples=_examples(20))
@given(data=st.data(), kind=_CORRUPTIONS, where=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_load_with_a_corrupt_file_is_identical_or_names_it(workdirs, tmp_path_factory, data,
                                                           kind, where, seed):
  """mtp.load of either workdir: identical parameters, tokenizer and config, or the file named."""
  copy, files, expected = _copy(workdirs, tmp_path_factory)
  relative = data.draw(st.sampled_from(files), label='file')
  path = copy / relative
  event(f'corrupted {relative.split("/")[1] if "/" in relative else relative}')
  if not _corrupt(path, kind, where, seed):
    return
  for name in ('base', 'heads'):
    # The heads workdir reads its trunk from the base workdir: a corrupt base file may surface
    # there too, and must be named there too.
    if name == relative.split('/')[0] or name == 'heads':
      _check_load(name, copy, path, expected[name])


@settings(max_examples=_examples(3))
@given(kind=_CORRUPTIONS, where=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_generate_auto_tree_with_a_corrupt_accuracies_cache(workdirs, tmp_path_factory, kind,
                                                            where, seed):
  """A corrupt head_accuracies.json in the measurement cache is measured again (or, still a
  valid table, read as written): greedy output is unchanged, the cache is usable afterwards,
  and nothing is written into the workdir."""
  from mtp.decode import calibration
  from mtp.decode import cost_model
  from mtp.decode import measurements
  root, _, _ = workdirs
  before = sorted(p.name for p in (root / 'base').iterdir())
  loaded = mtp.load(root / 'base')
  calibrated = []

  def fake_calibrate(model, *args, **kwargs):
    del args, kwargs
    calibrated.append(model)
    return _fake_accuracies(model.mtp_num_heads)

  cache = tmp_path_factory.mktemp('cache')  # This example's own: other tests read the session's.
  with mock.patch.dict(os.environ, {'MTP_CACHE_DIR': str(cache)}), \
      mock.patch.object(cost_model, 'step_cost', lambda model, **kwargs: _CURVE), \
      mock.patch.object(calibration, 'calibrate', fake_calibrate):
    calibration.workdir_accuracies(loaded)
    path = pathlib.Path(measurements.root() / 'head_accuracies.json')
    assert len(calibrated) == 1 and path.is_file()
    _corrupt(path, kind, where, seed)
    unreadable = not _still_valid_json(path)
    event(f'{kind}: {"unreadable" if unreadable else "still valid JSON"}')
    with _watchdog(300):
      auto = mtp.generate(loaded, _PROMPTS, max_new_tokens=8, decoder='speculative',
                          tree='auto')
    if unreadable:
      assert len(calibrated) == 2, 'an unreadable cache was not measured again'
    measured = len(calibrated)
    calibration.workdir_accuracies(loaded)
    assert len(calibrated) == measured, 'the cache is not usable after the generation'
  reference = mtp.generate(loaded, _PROMPTS, max_new_tokens=8, decoder='autoregressive')
  assert [g.tokens for g in auto] == [g.tokens for g in reference]
  assert sorted(p.name for p in (root / 'base').iterdir()) == before


@pytest.fixture(scope='module')
def resumed(workdirs, tmp_path_factory):
  """The base workdir's parameters after resuming it, uncorrupted, for one more step."""
  root, _, _ = workdirs
  copy = tmp_path_factory.mktemp('resumed') / 'base'
  shutil.copytree(root / 'base', copy)
  trainer_lib.train_and_evaluate(_config(num_train_steps=3), copy)
  return _flat_params(mtp.load(copy)), _losses(copy)


@settings(max_examples=_examples(3))
@given(data=st.data(), kind=_CORRUPTIONS, where=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_resume_with_a_corrupt_file_is_identical_or_names_it(workdirs, resumed,
                                                             tmp_path_factory, data, kind,
                                                             where, seed):
  """Resuming training on a corrupt base workdir: the uncorrupted resume's result, or the file
  named."""
  copy, files, _ = _copy(workdirs, tmp_path_factory)
  candidates = [f for f in files if f.startswith('base/')]
  relative = data.draw(st.sampled_from(candidates), label='file')
  path = copy / relative
  if not _corrupt(path, kind, where, seed):
    return
  try:
    with _watchdog(300):
      trainer_lib.train_and_evaluate(_config(num_train_steps=3), copy / 'base')
  except Exception as e:  # noqa: BLE001
    event('resume failed')
    assert _names(e, path, copy / 'base'), f'{type(e).__name__} does not name {path}: {e}'
    return
  event('resume succeeded')
  if _still_valid_json(path):
    return  # An edit of a text file, resumed as written.
  expected_params, expected_losses = resumed
  _assert_same_params(_flat_params(mtp.load(copy / 'base')), expected_params)
  assert _losses(copy / 'base')[3] == expected_losses[3]


def test_a_flipped_byte_in_a_parameter_chunk_is_named(workdirs, tmp_path_factory):
  """A flipped byte in the largest parameter chunk: the load fails naming it, or is identical.

  (Found by test_load_with_a_corrupt_file_is_identical_or_names_it in the thorough profile: it
  loaded NaN or otherwise wrong parameters without an error. Fixed by checkpoint fingerprints.)
  """
  copy, _, expected = _copy(workdirs, tmp_path_factory)
  chunks = sorted((copy / 'base' / 'checkpoints' / '2' / 'params').glob('ocdbt.process_0/d/*'),
                  key=lambda p: p.stat().st_size)
  pristine = chunks[-1].read_bytes()
  for where in (0.3, 0.5, 0.7):
    chunks[-1].write_bytes(pristine)
    assert _corrupt(chunks[-1], 'flip', where, 0)
    _check_load('base', copy, chunks[-1], expected['base'])


def test_a_heads_only_workdir_without_base_json_is_named(workdirs, tmp_path_factory):
  """Deleting base.json: the load fails naming base.json (found by the load property test; it
  said 'the checkpoint is of another model')."""
  copy, _, expected = _copy(workdirs, tmp_path_factory)
  path = copy / 'heads' / 'base.json'
  path.unlink()
  _check_load('heads', copy, path, expected['heads'])


def test_a_flipped_byte_in_an_optimizer_chunk_is_named_on_resume(workdirs, resumed,
                                                                 tmp_path_factory):
  """Resuming with a flipped byte in the largest optimizer-state chunk: named, or identical.

  (It resumed from a wrong optimizer state and saved NaN parameters. Fixed with the above.)
  """
  copy, _, _ = _copy(workdirs, tmp_path_factory)
  chunks = sorted((copy / 'base' / 'checkpoints' / '2' / 'opt_state').glob(
      'ocdbt.process_0/d/*'), key=lambda p: p.stat().st_size)
  assert _corrupt(chunks[-1], 'flip', 0.5, 0)
  try:
    trainer_lib.train_and_evaluate(_config(num_train_steps=3), copy / 'base')
  except Exception as e:  # noqa: BLE001
    assert _names(e, chunks[-1], copy / 'base'), f'{type(e).__name__}: {e}'
    return
  _assert_same_params(_flat_params(mtp.load(copy / 'base')), resumed[0])
