"""Test session setup: 8 simulated CPU devices (before JAX starts), quiet library logs, a
measurement cache of the session's own, and one tiny trained workdir the tests share."""

import os
import tempfile

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Measurements (break-evens, accuracies, token counts) and corpora of this session: tests never
# read a user's ~/.cache/mtp, and xdist workers (which inherit the variable) share one.
os.environ.setdefault('MTP_CACHE_DIR', tempfile.mkdtemp(prefix='mtp-test-cache-'))

import jax  # noqa: E402

# Many tests compile the same small programs; a persistent cache shared by the session (and by
# xdist workers) compiles each once.
_CACHE = os.path.join(tempfile.gettempdir(), 'mtp-test-jax-cache')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


# absl entry points (launch.*, benchmarks.*) define their flags on the one global FLAGS at import,
# several under the same names (--workdir), so two of them cannot be imported side by side. Each
# test module gets the flags of the entry points it imported: the others' are dropped before it
# is imported (collection) and before its tests run, when its entry points are imported again.
import importlib  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

_ENTRY_POINTS = ('launch.', 'benchmarks.')
_flags_owner = None


def _drop_entry_point_flags() -> None:
  for name in list(flags.FLAGS):
    module = flags.FLAGS.find_module_defining_flag(name) or ''
    if module.startswith(_ENTRY_POINTS) and name in flags.FLAGS:
      delattr(flags.FLAGS, name)


def pytest_collectstart(collector):
  if isinstance(collector, pytest.Module):
    _drop_entry_point_flags()


def pytest_runtest_setup(item):
  global _flags_owner
  module = getattr(item, 'module', None)
  if module is None or module is _flags_owner:
    return
  _flags_owner = module
  entry_points = [m for m in vars(module).values()
                  if isinstance(m, types.ModuleType) and m.__name__.startswith(_ENTRY_POINTS)]
  if entry_points:
    _drop_entry_point_flags()
    for entry_point in entry_points:
      importlib.reload(entry_point)


@pytest.fixture(scope='session')
def tiny_workdir(tmp_path_factory):
  """One tiny trained workdir for the session (configs/tiny.py, 2 steps, a chat template
  beside its tokenizer): trained once per test process. Read it; copy it to change it."""
  from mtp.serving import testing  # pylint: disable=import-outside-toplevel
  return testing.tiny_workdir(tmp_path_factory.mktemp('tiny') / 'workdir')
