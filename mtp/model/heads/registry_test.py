"""The rule that keeps a head family one module: outside mtp/model/heads/, code calls the
`HeadFamily` protocol and reads the registry, and never branches on a family's name or repeats a
family's options. Otherwise adding a family means finding every such place by hand, and a place
missed fails late (mtp/train/flops.py once branched on every family: a new family trained, and
its run had no TFLOP/s).

What the rule forbids, in the Python sources of mtp/, launch/ and configs/ (tests and
mtp/model/heads/ aside):
  * a family's name (a key of `heads.FAMILIES`) as a string compared with anything (`==`, `!=`,
    `in`, also inside a tuple, list or set compared with), as a dict key, as a subscript
    (`FAMILIES['eagle']`) or as a `case` pattern; and any line the project's before-stop check
    greps for (`== 'medusa'`, `in ('medusa'`, ...), comments included;
  * in mtp/ and launch/, a family's option (a key of its `OPTIONS`) read by name: a string
    equal to it, an attribute (`config.model.medusa_num_layers`) or a keyword argument;
  * in configs/base.py, the defaults every config starts from, any mention of a family's option:
    it copies them from the registry.
What it allows: a family's name as a value (`c.model.mtp_head_type = 'eagle'` in a config that
chooses its family, a default argument) or inside a sentence (docstrings, help texts), and a
config for one experiment setting its family's options.
"""

import ast
import pathlib
import re
from typing import Iterator, Mapping

import pytest

from configs import base
from mtp.model import heads

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCANNED = ('mtp', 'launch', 'configs')
FAMILY_MODULES = ROOT / 'mtp' / 'model' / 'heads'
BASE_CONFIG = ROOT / 'configs' / 'base.py'
OPTIONS_READ_IN = ('mtp', 'launch')  # configs/ for one experiment may set their family's.


def _sources() -> list[pathlib.Path]:
  """The Python files the rule covers."""
  return sorted(p for top in SCANNED for p in (ROOT / top).rglob('*.py')
                if FAMILY_MODULES not in p.parents and not p.name.endswith('_test.py'))


def _options() -> dict[str, str]:
  """Every registered family's option -> the family's name."""
  return {key: name for name, family in heads.FAMILIES.items() for key in family.OPTIONS}


def _hook_pattern(names) -> re.Pattern:
  """The comparisons the before-stop check greps for, over `names`."""
  alternatives = '|'.join(map(re.escape, names))
  return re.compile(rf"(==|!=|in \(|in \[)\s*['\"]({alternatives})['\"]")


def _named(node: ast.AST, names) -> bool:
  """A string constant in `names`, or a tuple, list or set holding one."""
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return any(_named(element, names) for element in node.elts)
  return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names


def family_branches(source: str, names) -> Iterator[int]:
  """Lines of `source` that branch on one of the family `names` (see the module docstring)."""
  pattern = _hook_pattern(names)
  for number, line in enumerate(source.splitlines(), 1):
    if pattern.search(line):
      yield number
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
    elif isinstance(node, ast.Dict):
      operands = [key for key in node.keys if key is not None]
    elif isinstance(node, ast.Subscript):
      operands = [node.slice]
    elif isinstance(node, ast.MatchValue):
      operands = [node.value]
    else:
      continue
    if any(_named(operand, names) for operand in operands):
      yield node.lineno


def option_reads(source: str, options) -> Iterator[int]:
  """Lines of `source` that name one of the family `options` in code (not inside a sentence)."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Constant) and node.value in options:
      yield node.lineno
    elif isinstance(node, ast.Attribute) and node.attr in options:
      yield node.lineno
    elif isinstance(node, ast.keyword) and node.arg in options:
      yield node.lineno


def option_mentions(source: str, options) -> Iterator[int]:
  """Lines of `source` that mention one of the family `options` anywhere, comments included."""
  pattern = re.compile(rf'\b({"|".join(map(re.escape, options))})\b')
  for number, line in enumerate(source.splitlines(), 1):
    if pattern.search(line):
      yield number


def _findings(checks: Mapping[pathlib.Path, Iterator[int]]) -> list[str]:
  """'path:line: text' for every line the checks found, each once."""
  found = []
  for path, lines in checks.items():
    text = path.read_text().splitlines()
    found += [f'{path.relative_to(ROOT)}:{n}: {text[n - 1].strip()}' for n in sorted(set(lines))]
  return found


def test_no_code_outside_the_family_modules_branches_on_a_family_name():
  names = set(heads.FAMILIES)
  found = _findings({p: family_branches(p.read_text(), names) for p in _sources()})
  assert not found, ('Branches on a head family outside mtp/model/heads/ (move the family\'s '
                     'behaviour into its module, behind a HeadFamily method):\n'
                     + '\n'.join(found))


def test_no_code_outside_the_family_modules_reads_a_family_option():
  options = _options()
  sources = [p for p in _sources() if p.relative_to(ROOT).parts[0] in OPTIONS_READ_IN]
  found = _findings({p: option_reads(p.read_text(), options) for p in sources})
  assert not found, ('Head-family options read outside mtp/model/heads/ (the family receives '
                     'them as `options`):\n' + '\n'.join(found))


def test_the_base_config_does_not_repeat_family_options():
  found = _findings({BASE_CONFIG: option_mentions(BASE_CONFIG.read_text(), _options())})
  assert not found, ('configs/base.py repeats head-family options (it fills them in from '
                     'mtp.model.heads.FAMILIES; document them beside the family\'s OPTIONS):\n'
                     + '\n'.join(found))


NAMES, OPTIONS = {'medusa', 'eagle'}, {'medusa_num_layers'}


@pytest.mark.parametrize('source', [
    "if kind == 'medusa':\n  pass",
    'ok = "eagle" != kind',
    "ok = kind in ('parallel', 'medusa')",
    "ok = kind not in {'eagle'}",
    "COUNTS = {'medusa': 1}",
    "family = FAMILIES['eagle']",
    "match kind:\n  case 'eagle':\n    pass",
    "x = 1  # if kind == 'medusa', ...",  # The before-stop check greps comments too.
])
def test_the_check_finds_branches_on_a_family(source):
  assert list(family_branches(source, NAMES))


@pytest.mark.parametrize('source', [
    "c.model.mtp_head_type = 'eagle'",
    "def tiny(head_type='medusa'):\n  '''Families: medusa, eagle.'''",
    "HELP = 'one of medusa | eagle'",
    "ok = kind == 'medusa_like'",
])
def test_the_check_allows_a_family_name_as_a_value(source):
  assert not list(family_branches(source, NAMES))


@pytest.mark.parametrize('source', [
    "layers = options['medusa_num_layers']",
    'layers = config.model.medusa_num_layers',
    'build(medusa_num_layers=2)',
])
def test_the_check_finds_an_option_read_by_name(source):
  assert list(option_reads(source, OPTIONS))


def test_the_check_allows_an_option_in_a_sentence():
  assert not list(option_reads("'''Deeper heads: see `medusa_num_layers`.'''", OPTIONS))


def test_the_check_finds_an_option_repeated_in_the_base_config():
  source = 'c.model.mtp_head_type = "medusa"\nc.model.medusa_num_layers = 1  # per head\n'
  assert list(option_mentions(source, OPTIONS)) == [2]


def test_the_base_config_holds_every_family_option_with_its_default(monkeypatch):
  families = dict(heads.FAMILIES)
  model = base.get_config().model
  for family in families.values():
    assert {key: model[key] for key in family.OPTIONS} == dict(family.OPTIONS)
  # No option shadows a key of the base config's own, or another family's: the base config
  # would quietly take the family's default for it.
  monkeypatch.setattr(heads, 'FAMILIES', {})
  keys = set(base.get_config().model)
  for name, family in sorted(families.items()):
    assert not keys & set(family.OPTIONS), name
    keys |= set(family.OPTIONS)
