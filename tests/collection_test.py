"""Collecting the suite imports neither torch nor transformers: each test worker loads them only
if it runs a test that needs them (the transformers oracles), not for every test it runs."""

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
