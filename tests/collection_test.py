"""The test processes import neither torch nor transformers: collecting the suite loads neither,
and no test imports them; their oracles run in processes of their own
(`mtp.testing.oracle_process`, or a benchmark's command), so no worker holds torch's threads
beside JAX's (torch was a suspect for the suite's XLA:CPU crashes: Makefile)."""

import ast
import pathlib
import subprocess
import sys

from mtp import testing

_SCRIPT = """
import sys
import pytest

class Check:
  def pytest_collection_finish(self, session):
    loaded = sorted({'torch', 'transformers'} & set(sys.modules))
    print('LOADED', ','.join(loaded) or '-')

pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-p', 'no:warnings'],
            plugins=[Check()])
"""


def test_collecting_the_suite_imports_no_torch():
  out = subprocess.run([sys.executable, '-c', _SCRIPT], capture_output=True, text=True,
                       env=testing.child_env(), timeout=600, check=False).stdout
  loaded = [line for line in out.splitlines() if line.startswith('LOADED ')]
  assert loaded == ['LOADED -'], loaded or out[-2000:]


_PEERS = {'torch', 'transformers'}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports_a_peer(tree: ast.AST) -> list[int]:
  """Lines of `tree` that import torch or transformers, or ask pytest to."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [node.module or '']
    elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'importorskip'
          and node.args and isinstance(node.args[0], ast.Constant)):
      names = [str(node.args[0].value)]
    else:
      continue
    if any(name.split('.')[0] in _PEERS for name in names):
      lines.append(node.lineno)
  return sorted(lines)


def test_no_test_module_imports_torch():
  """Test modules and conftest files run torch and transformers only in child processes."""
  found = []
  for path in sorted(ROOT.rglob('*.py')):
    parts = path.relative_to(ROOT).parts
    if {'venv', '.venv', 'workdirs', 'build'} & set(parts):
      continue
    if path.name.endswith('_test.py') or path.name == 'conftest.py':
      found += [f'{path.relative_to(ROOT)}:{line}'
                for line in _imports_a_peer(ast.parse(path.read_text()))]
  assert not found, found
  bad = ast.parse('import torch\nfrom transformers import AutoModel\n'
                  'import pytest\npytest.importorskip("torch")\nx = "import torch"\n')
  assert _imports_a_peer(bad) == [1, 2, 4]  # The check sees code, not strings.
