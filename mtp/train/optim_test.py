"""The learning-rate schedules: cosine over the run, and warmup-stable-decay, which continues a
constant-rate run exactly before it anneals."""

import ml_collections
import numpy as np
import pytest

from configs import base
from mtp.train import optim


def _optim(**overrides) -> ml_collections.ConfigDict:
  c = base.get_config().optim
  c.update(overrides)
  return c


def _rates(config, num_train_steps, peak=1e-3):
  schedule = optim.learning_rate_schedule(config, num_train_steps, peak)
  return np.array([float(schedule(step)) for step in range(num_train_steps + 1)])


def test_cosine_over_the_whole_run_is_the_default():
  rates = _rates(_optim(warmup_steps=10, end_lr_fraction=0.1), 100)
  np.testing.assert_allclose(rates[[0, 5, 10]], [0.0, 5e-4, 1e-3], rtol=1e-6)
  assert np.all(np.diff(rates[10:]) < 0)  # Decays from the end of warm-up on.
  np.testing.assert_allclose(rates[100], 1e-4, rtol=1e-6)


def test_warmup_stable_decay_holds_the_peak_then_anneals_over_its_last_steps():
  rates = _rates(_optim(warmup_steps=10, end_lr_fraction=0.1, decay_steps=40), 100)
  np.testing.assert_allclose(rates[[0, 5]], [0.0, 5e-4], rtol=1e-6)
  np.testing.assert_allclose(rates[10:61], 1e-3, rtol=1e-6)
  assert np.all(np.diff(rates[60:]) < 0)
  np.testing.assert_allclose(rates[80], 0.55e-3, rtol=1e-6)  # Cosine's midpoint.
  np.testing.assert_allclose(rates[100], 1e-4, rtol=1e-6)


def test_a_constant_run_resumed_with_a_decay_continues_it_exactly():
  constant = _rates(_optim(warmup_steps=10, end_lr_fraction=1.0), 640)
  annealed = _rates(_optim(warmup_steps=10, end_lr_fraction=0.0, decay_steps=160), 800)
  np.testing.assert_allclose(annealed[:641], constant, rtol=1e-6)
  assert annealed[800] == 0.0


def test_decay_over_every_step_needs_no_warm_up():
  rates = _rates(_optim(warmup_steps=10, end_lr_fraction=0.0, decay_steps=50), 50)
  np.testing.assert_allclose(rates[0], 1e-3, rtol=1e-6)
  assert rates[50] == 0.0


@pytest.mark.parametrize('overrides, message', [
    (dict(decay_steps=-1), 'optim.decay_steps must be between 0'),
    (dict(decay_steps=101), r'num_train_steps \(100\), got 101'),
    (dict(end_lr_fraction=1.5), 'optim.end_lr_fraction must be between 0 and 1'),
    (dict(end_lr_fraction=-0.1), 'optim.end_lr_fraction must be between 0 and 1'),
])
def test_bad_schedule_values_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    optim.validate(_optim(**overrides), 100)
