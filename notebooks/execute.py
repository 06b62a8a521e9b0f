r"""Runs the notebooks: each jupytext source (`notebooks/NN_name.py`) into its paired `.ipynb`.

  python -m notebooks.execute                  # every notebook, full size, outputs saved
  python -m notebooks.execute 01_quickstart --docs   # one, then refresh the README's figure
  MTP_NOTEBOOK_FAST=1 python -m notebooks.execute    # CI's tiny sizes

The `.py` files are the sources (readable diffs); the `.ipynb` files are what GitHub and Colab
show, so they are committed with the outputs of a real run. Before executing, every source
(its Colab badge and its clone URL) and the README's badges are stamped with `REPOSITORY`, the
one place that names the repository.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import time

FOLDER = pathlib.Path(__file__).resolve().parent
ROOT = FOLDER.parent
REPOSITORY = 'your-org/mtp'  # GitHub owner/name: the Colab badges and the clone on Colab.
# The README's figure: which notebook draws it, and where it lands.
DOCS_FIGURE = ('01_quickstart', 'learning_curves.png', ROOT / 'docs' / 'quickstart.png')
TIMEOUT_S = 3600  # per cell


def names() -> list[str]:
  """The notebooks, in order: `NN_name` for each `notebooks/NN_name.py`."""
  return sorted(p.stem for p in FOLDER.glob('[0-9][0-9]_*.py'))


def stamped(text: str) -> str:
  """`text` (a notebook's source, the README) with its Colab badges and REPOSITORY line naming
  `REPOSITORY`."""
  text = re.sub(r'(colab\.research\.google\.com/github/)[^/\s]+/[^/\s]+(/blob/main/notebooks/)',
                rf'\g<1>{REPOSITORY}\g<2>', text)
  return re.sub(r"^REPOSITORY = '[^']*'", f"REPOSITORY = '{REPOSITORY}'", text, flags=re.M)


def stamp(path: pathlib.Path) -> None:
  text = path.read_text(encoding='utf-8')
  if stamped(text) != text:
    path.write_text(stamped(text), encoding='utf-8')


def read(name: str):
  """The notebook of `notebooks/<name>.py`, without outputs."""
  import jupytext
  return jupytext.reads((FOLDER / f'{name}.py').read_text(encoding='utf-8'), fmt='py:percent')


def code_cells(notebook) -> list[tuple[str, str]]:
  """(cell type, source) of every cell: what must agree between a source and its .ipynb."""
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def execute(name: str, output: pathlib.Path | None = None, fast: bool | None = None):
  """Executes notebook `name` from the repository root and writes it, outputs included.

  Args:
    name: `NN_name`.
    output: where to write the executed notebook (default: `notebooks/<name>.ipynb`).
    fast: run with `MTP_NOTEBOOK_FAST=1` (None: as the environment says).

  Returns:
    The executed notebook's wall time in seconds.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised; the message holds its traceback.
  """
  import nbclient
  import nbformat
  stamp(FOLDER / f'{name}.py')
  notebook = read(name)
  env = dict(os.environ)
  if fast is not None:
    env['MTP_NOTEBOOK_FAST'] = '1' if fast else '0'
  client = nbclient.NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name='python3',
                                   resources={'metadata': {'path': str(ROOT)}})
  start = time.perf_counter()
  saved = dict(os.environ)
  os.environ.update(env)  # The kernel inherits this process's environment.
  try:
    client.execute()
  finally:
    os.environ.clear()
    os.environ.update(saved)
  seconds = time.perf_counter() - start
  nbformat.write(notebook, str(output or FOLDER / f'{name}.ipynb'))
  return seconds


def main(argv: list[str]) -> None:
  docs = '--docs' in argv
  wanted = [a for a in argv if not a.startswith('--')] or names()
  unknown = sorted(set(wanted) - set(names()))
  if unknown:
    raise SystemExit(f'unknown notebook(s) {unknown}; there are {names()}')
  stamp(ROOT / 'README.md')
  for name in wanted:
    seconds = execute(name)
    print(f'{name}: executed in {seconds:.0f} s -> notebooks/{name}.ipynb')
  if docs:
    notebook, figure, target = DOCS_FIGURE
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(ROOT / 'results' / 'notebooks' / notebook / figure, target)
    print(f'README figure: {target.relative_to(ROOT)}')


if __name__ == '__main__':
  main(sys.argv[1:])
