"""absl entry points: train, generate, demo."""

import logging as _std_logging

from absl import logging


class _QuietLibraries(_std_logging.Filter):
  """Drops INFO records of chatty libraries (Orbax logs every file it writes), and Orbax's
  warnings that a checkpoint we only read is opened read-only (which is what we asked for)."""
  _NOISY = ('/orbax/', '/grain/')

  def filter(self, record: _std_logging.LogRecord) -> bool:
    if not any(part in record.pathname for part in self._NOISY):
      return True
    if record.levelno >= _std_logging.WARNING:
      message = record.getMessage()
      return 'read_only=True' not in message and 'read only' not in message
    return False


def quiet_library_logs() -> None:
  logging.get_absl_handler().addFilter(_QuietLibraries())


# Exit codes of every launcher (the README lists them).
EXIT_ERROR = 1        # bad input, a missing or corrupt file: one line on stderr says which
EXIT_USAGE = 2        # wrong flags (absl's own code)


def show_traceback() -> bool:
  """Tracebacks are for developers: `--verbosity=1` (or higher) or MTP_TRACEBACK=1 asks."""
  import os
  return os.environ.get('MTP_TRACEBACK', '') not in ('', '0') or logging.get_verbosity() >= 1


class UserError:
  """`with UserError('launch.generate'):` turns the errors a user can fix into one line on
  stderr and exit code `EXIT_ERROR` (the traceback too when `show_traceback()`)."""
  # ValueError: bad input (config, prompts, flags); OSError: files and directories;
  # CheckpointError is a RuntimeError: matched by name to keep this module free of mtp imports.
  _CAUGHT = (ValueError, OSError, OverflowError, KeyError)

  def __init__(self, program: str):
    self.program = program

  def __enter__(self):
    return self

  def __exit__(self, kind, error, tb):
    if error is None or not (isinstance(error, self._CAUGHT)
                             or type(error).__name__ == 'CheckpointError'):
      return False
    if show_traceback():
      import traceback
      traceback.print_exception(kind, error, tb)
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    raise SystemExit(f'{self.program}: {message}')
