"""The decode layer's rules, checked on the sources, so that the next change cannot break them
silently: one door into the loop, one registry of tree names, each shared rule written once,
drafters as plug-ins, export below the API, and the sizes the design keeps."""

import ast
import pathlib
import re

import pytest

from mtp.decode import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
DECODE = ROOT / 'mtp' / 'decode'
SKIP = {'.venv', 'venv', 'workdirs', 'results', 'build', 'dist', 'node_modules'}


def _sources(*tops: str, tests: bool = True):
  for top in tops:
    for path in sorted((ROOT / top).rglob('*.py')):
      if SKIP & set(path.relative_to(ROOT).parts) or path == pathlib.Path(__file__).resolve():
        continue
      if not tests and path.name.endswith('_test.py'):
        continue
      yield path


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number, text) of the lines that are code, not docstrings or comments."""
  tree = ast.parse(path.read_text())
  docstrings = set()
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
        getattr(body[0], 'value', None), ast.Constant) and isinstance(body[0].value.value, str):
      docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
  return [(n, line.split('#')[0]) for n, line in enumerate(path.read_text().splitlines(), 1)
          if n not in docstrings]


def _name(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _hits(pattern: str, paths, allowed=()) -> list[str]:
  """'file:line: code' of every code line (not docstrings or comments) matching `pattern`."""
  regex = re.compile(pattern)
  return [f'{_name(p)}:{n}: {line.strip()}' for p in paths if _name(p) not in allowed
          for n, line in _code_lines(p) if regex.search(line)]


def test_one_door_into_the_loop():
  """Only the engine runs the loop's entry points; no module, tests included, calls a private
  function of the loop or the engine; compilations are counted publicly."""
  everything = list(_sources('mtp', 'launch', 'benchmarks', 'tests', 'notebooks'))
  assert not _hits(r'\bloop(_lib)?\.(prefill|run|splice|stop)\(', everything,
                   allowed={'mtp/decode/engine.py'})
  assert not _hits(r'\b(loop|engine)(_lib)?\._[a-z]', everything)
  assert not _hits(r'_cache_size\(', everything,
                   allowed={'mtp/train/step_test.py'})  # The train step's, not a decoder's.
  assert not _hits(r'from mtp\.decode import (driver|request|speculative|autoregressive)\b',
                   everything)


def test_the_loop_names_no_drafter():
  """A drafter is one module: the loop and the engine know the protocol, not the drafters."""
  assert not _hits(r'drafters\.(heads|dynamic|lookup|ngram)|drafters import (heads|dynamic|lookup'
                   r'|ngram)', [DECODE / 'loop.py', DECODE / 'engine.py'])


def test_tree_names_live_in_one_registry():
  paths = [p for p in _sources('mtp', 'launch', tests=False)
           if p.relative_to(ROOT).as_posix() != 'mtp/decode/trees.py']
  assert not _hits(r"""['"](chain|dynamic)['"]""", paths)
  assert not _hits(r"""(==|!=|in \(|in \[)\s*['"](default|auto)['"].*tree|tree\w*\s*(==|!=)\s*"""
                   r"""['"](default|auto)['"]""", paths)


def test_each_shared_rule_is_written_once():
  code = list(_sources('mtp', 'launch', 'benchmarks', tests=False))
  # The ids decoders never emit: the pad id unless it doubles as EOS.
  assert not _hits(r'pad_id (in \(|!= tokenizer\.eos_id|== tokenizer\.eos_id)', code,
                   allowed={'mtp/data/tokenizer.py'})
  # Why a row finished, and its name.
  assert not _hits(r"""['"](eos|length)['"] if|finish_reason = ['"]""", code)
  # The prompt width a prompt is padded to.
  assert not _hits(r'PROMPT_WIDTH_MULTIPLE|multiple=32', code)
  # Files replaced atomically: one helper (`paths.write_atomically`); what else renames moves
  # whole directories into place or streams a download.
  assert not _hits(r'os\.replace\(|tmp\.replace\(|mkstemp\(', code, allowed={
      'mtp/checkpoint/paths.py', 'launch/generate.py', 'mtp/pretrained/smollm2.py',
      'mtp/data/pipeline.py', 'mtp/train/trunk_cache.py'})


def test_export_never_imports_the_api():
  export = list(_sources('mtp/export', tests=False))
  assert not _hits(r'from mtp import api|mtp\.api\b|mtp\.load\(|import mtp$', export)


def test_auto_lives_in_its_module_and_the_plan():
  """`auto` is its module (the policy and its measurement), its registry entry and the plan
  that resolves it (an exported artifact maps it onto its speculative program)."""
  code = [p for p in _sources('mtp', 'launch', tests=False)]
  assert {h.split(':')[0] for h in _hits(r'from mtp\.decode import auto\b|\.adaptive\b', code)} \
      <= {'mtp/decode/plan.py', 'mtp/decode/decoders.py', 'mtp/export/runtime.py'}


def test_the_sizes_the_design_keeps():
  api = (ROOT / 'mtp' / 'api.py').read_text()
  assert len(api.splitlines()) <= 300
  generate = next(n for n in ast.parse(api).body
                  if isinstance(n, ast.FunctionDef) and n.name == 'generate')
  assert generate.end_lineno - generate.lineno + 1 <= 60
  assert len((DECODE / 'loop.py').read_text().splitlines()) <= 400
  fields = [f for f in loop.LoopState.__dataclass_fields__ if f not in ('drafters', 'policy')]
  assert len(fields) <= 12, fields


def test_the_checks_see_a_break_in_code_not_in_prose(tmp_path):
  """The checks above can fail: code that breaks a rule is caught; a docstring or a comment
  that mentions it is not."""
  bad = tmp_path / 'bad.py'
  bad.write_text('"""Calls loop.run( in a docstring."""\n\n# engine._prefill in a comment\n'
                 'state = loop.run(model, data, plan, state, 3)\nout = engine._prefill(1)\n')
  assert len(_hits(r'\bloop(_lib)?\.(prefill|run|splice|stop)\(', [bad])) == 1
  assert len(_hits(r'\b(loop|engine)(_lib)?\._[a-z]', [bad])) == 1
