"""Test session setup: 8 simulated CPU devices (before JAX starts), quiet library logs, a
measurement cache of the session's own, one tiny trained workdir the tests share, and a local
Cloud Storage (`gcs_bucket`)."""

import os
import tempfile

# Set before JAX starts, here and in every process a test starts (`mtp.testing.child_env`).
# Tests run tiny programs, most compiled once: XLA:CPU's compile, not the run, is most of the
# suite's time. Without LLVM's optimisations and XLA's fusion emitters it compiles about 2.3x
# faster (two decoding tests: 37 s against 87 s on 2 AVX2 cores); the programs run slower. One
# LLVM module a program, not split for parallel code generation (which 2 busy cores cannot
# use), cuts XLA's compile time by 10-24% more (api and eagle_tree tests: 88 s against 115 s).
COMPILE_FAST_XLA_FLAGS = ('--xla_backend_optimization_level=0 '
                          '--xla_llvm_disable_expensive_passes=true '
                          '--xla_cpu_use_fusion_emitters=false '
                          '--xla_cpu_parallel_codegen_split_count=1')
os.environ.setdefault('XLA_FLAGS',
                      f'--xla_force_host_platform_device_count=8 {COMPILE_FAST_XLA_FLAGS}')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Each op's location in a lowered program holds one frame, not its whole Python traceback:
# lowering 27% and XLA's compile 15% faster (api and eagle_tree tests, 118 s against 109 s).
os.environ.setdefault('JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS', 'false')
# Many tests compile the same small programs; a persistent cache shared by the session, its xdist
# workers and the processes they start compiles each once.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), 'mtp-test-jax-cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
# A folder of this session's own, which its xdist workers (inheriting the variable) share and
# the session removes at its end: what it builds once (`mtp.testing.built_once`) and, unless
# MTP_CACHE_DIR names another, its measurements (break-evens, accuracies, token counts) and
# corpora. Tests never read a user's ~/.cache/mtp.
_SESSION_DIR = None
if 'MTP_TEST_SESSION_DIR' not in os.environ:
  _SESSION_DIR = os.environ['MTP_TEST_SESSION_DIR'] = tempfile.mkdtemp(prefix='mtp-test-')
os.environ.setdefault('MTP_CACHE_DIR', os.path.join(os.environ['MTP_TEST_SESSION_DIR'], 'cache'))
os.makedirs(os.environ['MTP_CACHE_DIR'], exist_ok=True)

# Before gcsfs is first imported, which reads it: see tests/gcs_emulator.py.
os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')

# absl entry points (launch.*, benchmarks.*) define their flags on the one global FLAGS at import,
# several under the same names (--workdir), so two of them cannot be imported side by side. Each
# test module gets the flags of the entry points it imported: the others' are dropped before it
# is imported (collection) and before its tests run, when its entry points are imported again.
import importlib  # noqa: E402
import shutil  # noqa: E402
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


def pytest_unconfigure(config):
  del config
  if _SESSION_DIR is not None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope='session')
def tiny_workdir(tmp_path_factory):
  """One tiny trained workdir for the session (configs/tiny.py, 2 steps, a chat template
  beside its tokenizer): trained once per test process. Read it; copy it to change it."""
  from mtp.serving import testing  # pylint: disable=import-outside-toplevel
  return testing.tiny_workdir(tmp_path_factory.mktemp('tiny') / 'workdir')


@pytest.fixture(scope='session')
def gcs_emulator():
  """A local Cloud Storage for this test process (tests/gcs_emulator.py), with every client of
  this process and of its subprocesses pointed at it: its URL."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from tests import gcs_emulator as emulator  # pylint: disable=import-outside-toplevel
  # It ends when its standard input closes, as this process exits (tests/gcs_emulator.py).
  process = subprocess.Popen([sys.executable, '-m', 'tests.gcs_emulator', '--port=0'],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             # Clients that close a connection early make it print tracebacks.
                             stderr=subprocess.DEVNULL,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
  url = process.stdout.readline().strip()
  if not url.startswith('http://'):
    process.kill()
    raise RuntimeError(f'The Cloud Storage emulator did not start (it printed {url!r}).')
  os.environ.update(emulator.environment(url))
  return url


@pytest.fixture
def gcs_bucket(gcs_emulator, request):
  """`gs://bucket/<test name>`: a directory of its own on the local Cloud Storage, reached
  through the real clients (gcsfs under etils.epath, tensorstore under Orbax)."""
  import re  # pylint: disable=import-outside-toplevel
  import uuid  # pylint: disable=import-outside-toplevel
  import gcsfs  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  del gcs_emulator
  # Clients made before the emulator's variables were set would reach the real service.
  gcsfs.GCSFileSystem.clear_instance_cache()
  epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  name = re.sub(r'[^a-zA-Z0-9_-]+', '-', request.node.name)[:60]
  return f'gs://bucket/{name}-{uuid.uuid4().hex[:8]}'


@pytest.fixture(autouse=True)
def _machine_never_quiet(monkeypatch):
  """Tests see a busy machine: a timing cached as disturbed is measured again where the
  machine is quiet (`measurements.lookup`), which in a test would hang on what the other xdist
  worker happens to do. The tests of that rule set the machine's state themselves."""
  monkeypatch.setattr('mtp.decode.measurements.machine_quiet', lambda: False)
