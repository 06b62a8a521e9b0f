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
  """Filters the absl handler (entry points) and the `absl` logger (notebooks, plain Python)."""
  logging.get_absl_handler().addFilter(_QuietLibraries())
  _std_logging.getLogger('absl').addFilter(_QuietLibraries())

