"""Why a row stopped, and what that is called: the one rule every caller reads.

The decode loop records each row's reason (`loop.LoopState.reason`); results carry it, and
`finish_reason` names it where results leave the library, in OpenAI's words. Importing this
module is free (no JAX), so an exported artifact's runtime reads the same rule.
"""

RUNNING, STOP_ID, LENGTH, CANCELLED = 0, 1, 2, 3
# A stop id (EOS, a chat template's end of turn) ended the row: 'stop'; its token budget:
# 'length'; the caller stopped it (a client that left): 'cancelled'.
NAMES = {STOP_ID: 'stop', LENGTH: 'length', CANCELLED: 'cancelled'}


def finish_reason(reason: int) -> str | None:
  """The name of a row's reason; None while it runs."""
  return NAMES.get(int(reason))
