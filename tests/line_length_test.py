"""Source lines stay within setup.cfg's 100 characters (flake8's max-line-length), so that a
change cannot let them grow silently: 11 had (trailing lint pragmas and URLs aside) when it came."""

import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = {'venv', 'workdirs', 'results', 'build', 'dist', 'node_modules'}  # And hidden ones.
# A trailing lint pragma may run past the limit, and a URL cannot be wrapped.
PRAGMA = re.compile(r'\s*#\s*(pylint:|noqa|type:).*$')


def _limit() -> int:
  config = configparser.ConfigParser()
  config.read(ROOT / 'setup.cfg')
  return config.getint('flake8', 'max-line-length')


def test_python_lines_fit_the_configured_length():
  limit = _limit()
  assert limit == 100
  long = []
  for path in sorted(ROOT.rglob('*.py')):
    parts = path.relative_to(ROOT).parts
    if SKIP & set(parts) or any(part.startswith('.') for part in parts):
      continue
    for number, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
      if '://' not in line and len(PRAGMA.sub('', line)) > limit:
        long.append(f'{path.relative_to(ROOT)}:{number} ({len(line)} characters)')
  assert not long, 'lines longer than setup.cfg allows:\n' + '\n'.join(long)
