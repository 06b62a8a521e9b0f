"""How the launchers fail: one line on stderr and an exit code a scheduler can act on.

Exit codes (README.md, "Exit codes"):
  0    done
  1    error: config, data, checkpoint, workdir lock, weights (one line names the problem)
  2    usage: an unknown flag or config key, an unreadable config file
  3    training diverged: a non-finite loss or gradient norm (the last good checkpoints stay)
  143  preempted (SIGTERM, 128 + 15; SLURM's SIGUSR1 too): a checkpoint was saved; the same
       command resumes

The traceback is printed too with `--verbosity=1` (or higher) or the environment variable
`MTP_TRACEBACK=1`.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, NoReturn, Sequence

from absl import flags
from absl import logging

OK = 0
ERROR = 1
USAGE = 2
DIVERGED = 3
PREEMPTED = 143


def show_traceback() -> bool:
  """Tracebacks are for developers: `--verbosity=1` (or higher) or MTP_TRACEBACK=1 asks."""
  return os.environ.get('MTP_TRACEBACK', '') not in ('', '0') or logging.get_verbosity() >= 1


class UserErrors:
  """`with UserErrors('launch.generate'):` turns the errors a user can fix (bad input, a
  missing or corrupt file) into `fail(program, error)`; anything else is a bug and keeps its
  traceback."""
  # CheckpointError and WorkdirLockedError (and their subclasses) are matched by name: this
  # module imports nothing of mtp, so that the launchers parse their flags before JAX starts.
  _CAUGHT = (ValueError, OSError, OverflowError, KeyError)
  _CAUGHT_NAMES = ('CheckpointError', 'WorkdirLockedError')

  def __init__(self, program: str):
    self.program = program

  def __enter__(self):
    return self

  def __exit__(self, kind, error, tb):
    if error is not None and (isinstance(error, self._CAUGHT) or any(
        kind.__name__ in self._CAUGHT_NAMES for kind in type(error).__mro__)):
      fail(self.program, error)
    return False


def begin(argv: Sequence[str], *, warnings_only: bool = False) -> None:
  """A launcher's first lines: no positional arguments (usage error otherwise), quiet library
  logs, and with `warnings_only` absl's own INFO lines too (Orbax logs every save and restore)
  unless --verbosity was given."""
  from absl import app  # pylint: disable=import-outside-toplevel
  import launch  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}', exitcode=USAGE)
  launch.quiet_library_logs()
  if warnings_only and not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)


def fail(program: str, error: BaseException, code: int = ERROR) -> NoReturn:
  """Exits with `code` after one line naming `error` (and its traceback, if
  `show_traceback()`)."""
  if show_traceback():
    traceback.print_exception(error)
  if isinstance(error, KeyError) and error.args:  # Not its repr, quotes and all.
    error = error.args[0]
  message = f'{program}: {error}'
  if code == ERROR:
    raise SystemExit(message) from None  # Python prints it and exits with 1.
  print(message, file=sys.stderr, flush=True)
  raise SystemExit(code) from None


def flags_parser(program: str) -> Callable[[Sequence[str]], list[str]]:
  """An `app.run(flags_parser=...)` that turns a bad flag, config file or config key into one
  line and exit code 2, in place of absl's exit code 1 or a traceback."""
  def parse(argv: Sequence[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      error = e
    except (AttributeError, KeyError) as e:  # ml_collections: no such config key.
      error = ValueError(_unknown_key(e))
      error.__cause__ = e
    except Exception as e:  # noqa: BLE001  An unreadable config file, a wrongly typed value.
      error = e
    fail(program, error, USAGE)
  return parse


def _unknown_key(error: BaseException) -> str:
  """ml_collections' error for an unknown key (an AttributeError around a KeyError whose text
  may add a "Did you mean ...?" line) as one line."""
  text = error
  while isinstance(text, BaseException) and text.args:
    text = text.args[0]
  key, _, hint = str(text).partition('\n')
  message = f"unknown config key '{key.strip(chr(34) + chr(39))}' in a --config.* flag"
  if hint.strip():
    message += f' ({hint.strip()})'
  return message + '; configs/base.py documents every key'
