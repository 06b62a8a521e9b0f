"""absl entry points: train, generate, demo."""

import logging as _std_logging

from absl import logging


class _QuietLibraries(_std_logging.Filter):
  """Drops INFO records of chatty libraries (Orbax logs every file it writes)."""
  _NOISY = ('/orbax/', '/grain/')

  def filter(self, record: _std_logging.LogRecord) -> bool:
    return record.levelno >= _std_logging.WARNING or not any(
        part in record.pathname for part in self._NOISY)


def quiet_library_logs() -> None:
  logging.get_absl_handler().addFilter(_QuietLibraries())
