"""Decoding imports nothing the GPU machine's image lacks (benchmarks/device.sh runs there).

That image has JAX, flax, optax, orbax, chex, absl, etils, tensorstore, transformers,
safetensors, tokenizers, matplotlib and tqdm; ml-collections travels as a wheel (device.sh
--prepare). It has no data pipeline (grain, array_record), GGUF reader or web server: `mtp.load`,
`mtp.generate` and the device benchmark must not import them.
"""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

from mtp import testing as mtp_testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Packages decoding must not import (nor any of their submodules).
ABSENT_ON_DEVICE = ('grain', 'array_record', 'gguf', 'fastapi', 'uvicorn')

_BLOCKER = '''\
"""Installed by benchmarks/device_imports_test.py: these packages cannot be imported."""
import sys

_BLOCKED = {blocked!r}


class _Blocker:

  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in _BLOCKED:
      raise ImportError(f'{{name}} is blocked: the GPU machine\\'s image lacks it')
    return None


sys.meta_path.insert(0, _Blocker())
'''


def blocking_env(directory: pathlib.Path, env=None) -> dict:
  """`env` (default os.environ) whose Python processes cannot import ABSENT_ON_DEVICE: a
  `sitecustomize` in `directory`, put first on PYTHONPATH, installs an import hook."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'sitecustomize.py').write_text(_BLOCKER.format(blocked=ABSENT_ON_DEVICE))
  env = dict(os.environ if env is None else env)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(directory), str(ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  return env


def device_script_imports() -> list[str]:
  """Every module benchmarks/device.py imports, at the top and inside its functions."""
  tree = ast.parse((ROOT / 'benchmarks' / 'device.py').read_text())
  names = {'benchmarks.device'}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
          and node.module != '__future__'):
      names.add(node.module)
      for alias in node.names:  # `from mtp.decode import plan`: plan may be a module.
        names.add(f'{node.module}.{alias.name}')
  return sorted(names)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_the_blocker_blocks(tmp_path):
  run = _run(f'''
      for name in {ABSENT_ON_DEVICE!r}:
        try:
          __import__(name)
        except ImportError:
          continue
        raise SystemExit(name + ' imported')
      ''', blocking_env(tmp_path / 'site'))
  assert run.returncode == 0, run.stdout + run.stderr


def test_load_generate_and_device_script_import_no_absent_package(tiny_workdir, tmp_path):
  env = blocking_env(tmp_path / 'site', mtp_testing.child_env(JAX_PLATFORMS='cpu'))
  run = _run(f'''
      import importlib
      import sys
      for name in {device_script_imports()!r}:
        try:
          importlib.import_module(name)
        except ModuleNotFoundError as e:
          if e.name != name:  # e.name == name: `from package import function`, not a module.
            raise
      import mtp
      loaded = mtp.load({str(tiny_workdir)!r})
      for decoder in ('autoregressive', 'speculative', 'auto'):
        [out] = mtp.generate(loaded, 'def f(x):', max_new_tokens=4, decoder=decoder)
        assert out.tokens, decoder
      bad = sorted(m for m in sys.modules if m.split('.')[0] in {ABSENT_ON_DEVICE!r})
      assert not bad, bad
      print('decoded')
      ''', env)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
  assert 'decoded' in run.stdout
