r"""Runs N processes of a multi-process JAX program on this machine, as a pod would.

  python -m launch.multiprocess --num_processes=2 [--module=launch.train] [--port=P] \
      [--grace_s=10] -- --config=configs/tiny.py --workdir=/tmp/run

Process i runs `python -m MODULE ARGS... --num_processes=N --process_id=i
--coordinator_address=HOST:PORT` (the flags launch.train takes), and its output is printed
line by line behind a `[i]` prefix.

When a process exits with an error or is killed, the others would wait in their next collective
for a peer that never comes. The runner stops them instead: SIGTERM, then SIGKILL after
`--grace_s` seconds, and it exits with the failed process's code (1 for a signal) after one line
on stderr naming the process, e.g.

  launch.multiprocess: process 1 of 2 (pid 4242) was killed by SIGKILL; stopped the other 1.

SIGTERM or SIGINT to the runner is passed on to every process (launch.train then saves a
checkpoint and exits with 143), and the runner waits for them all. A process that exits with 143
on its own was preempted (a signal to it alone): the others agree on the same step through JAX's
preemption service and exit with 143 too, so the runner waits for them rather than stopping them
mid-save.

The same launch.train command runs on a TPU pod's workers (launch/tpu_pod.py) and under SLURM
(launch/slurm_gpu.sbatch), where the cluster gives each process its id instead of this runner.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# launch.train's exit code after saving on SIGTERM (launch.cli.PREEMPTED).
PREEMPTED = 143
from typing import IO, Sequence

PROGRAM = 'launch.multiprocess'


def free_port() -> int:
  """A TCP port nothing listens on now (the coordinator binds it moments later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('', 0))
    return s.getsockname()[1]


def process_commands(module: str, args: Sequence[str], num_processes: int,
                     coordinator_address: str, python: str = sys.executable) -> list[list[str]]:
  """The command of each process: `python -m module args` plus its place in the run."""
  if num_processes < 1:
    raise ValueError(f'--num_processes must be at least 1, got {num_processes}.')
  return [[python, '-m', module, *args, f'--num_processes={num_processes}',
           f'--process_id={i}', f'--coordinator_address={coordinator_address}']
          for i in range(num_processes)]


@dataclasses.dataclass
class Failure:
  """The first process that failed, and how."""
  index: int
  pid: int
  returncode: int

  def describe(self, num_processes: int) -> str:
    if self.returncode < 0:
      how = f'was killed by {signal.Signals(-self.returncode).name}'
    else:
      how = f'exited with code {self.returncode}'
    return f'process {self.index} of {num_processes} (pid {self.pid}) {how}'

  @property
  def exit_code(self) -> int:
    return self.returncode if self.returncode > 0 else 1


def _stream(index: int, pipe: IO[str], out: IO[str], lock: threading.Lock) -> None:
  for line in pipe:
    with lock:
      out.write(f'[{index}] {line}' if line.endswith('\n') else f'[{index}] {line}\n')
      out.flush()


def run(commands: Sequence[Sequence[str]], *, grace_s: float = 10.0, poll_s: float = 0.1,
        out: IO[str] | None = None, err: IO[str] | None = None,
        env: dict[str, str] | None = None, cwd: str | None = None) -> int:
  """Runs the commands side by side until all succeed or one fails; returns the exit code.

  Args:
    commands: one argv per process.
    grace_s: after a failure, how long the others get to exit after SIGTERM before SIGKILL.
    poll_s: how often the processes are checked.
    out: where their prefixed output goes (stdout by default); err: the runner's own lines.
    env, cwd: the processes' environment and directory (the runner's by default).

  Returns:
    0 when every process exited with 0; else the first failure's code (1 for a signal), or,
    after a stop request (SIGTERM/SIGINT) or a preempted process (exit 143, not a failure), the
    first non-zero code among the processes.
  """
  out = out or sys.stdout
  err = err or sys.stderr
  env = dict(os.environ if env is None else env, PYTHONUNBUFFERED='1')
  lock = threading.Lock()
  # Each process in its own session: only the runner decides which signals they get.
  procs = [subprocess.Popen(list(c), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd, start_new_session=True)
           for c in commands]
  readers = [threading.Thread(target=_stream, args=(i, p.stdout, out, lock), daemon=True)
             for i, p in enumerate(procs)]
  for reader in readers:
    reader.start()
  with lock:
    err.write(f'{PROGRAM}: started {len(procs)} processes, pids '
              f'{" ".join(str(p.pid) for p in procs)}.\n')
    err.flush()

  stop_requested = threading.Event()
  preempted_seen = False

  def forward(signum, frame):
    del frame
    stop_requested.set()
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    del signum

  handlers = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      handlers[signum] = signal.signal(signum, forward)
  try:
    failure = None
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        break
      preempted = [i for i, c in enumerate(codes) if c == PREEMPTED]
      if preempted and not preempted_seen:
        preempted_seen = True
        with lock:
          err.write(f'{PROGRAM}: process {preempted[0]} of {len(procs)} was preempted (exit '
                    f'{PREEMPTED}); waiting for the others to save the same step.\n')
          err.flush()
      if not stop_requested.is_set():
        failed = [i for i, c in enumerate(codes) if c not in (None, 0, PREEMPTED)]
        if failed:
          i = failed[0]
          failure = Failure(i, procs[i].pid, codes[i])
          _stop(procs, grace_s)
          break
      time.sleep(poll_s)
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
  for reader in readers:
    reader.join(timeout=5)
  if failure is not None:
    others = len(procs) - 1
    with lock:
      err.write(f'{PROGRAM}: {failure.describe(len(procs))}; stopped the other {others}.\n')
      err.flush()
    return failure.exit_code
  codes = [p.returncode for p in procs]
  return next((c if c > 0 else 1 for c in codes if c), 0)


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to the processes still running, SIGKILL to those left after `grace_s`."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in running:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def main(argv: Sequence[str]) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog=f'python -m {PROGRAM}', description=__doc__.split('\n\n')[2],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      usage=f'python -m {PROGRAM} --num_processes=N [options] -- [program flags]')
  parser.add_argument('--num_processes', type=int, required=True,
                      help='processes to start on this machine')
  parser.add_argument('--module', default='launch.train',
                      help='the module each process runs (python -m MODULE)')
  parser.add_argument('--host', default='localhost', help='the coordinator host')
  parser.add_argument('--port', type=int, default=0,
                      help='the coordinator port (0: a free one)')
  parser.add_argument('--grace_s', type=float, default=10.0,
                      help='after a failure, seconds the others get between SIGTERM and SIGKILL')
  own, _, program_args = _split(argv)
  options = parser.parse_args(own)
  if options.num_processes < 1:
    parser.error(f'--num_processes must be at least 1, got {options.num_processes}')
  if options.grace_s < 0:
    parser.error(f'--grace_s must be >= 0, got {options.grace_s}')
  address = f'{options.host}:{options.port or free_port()}'
  commands = process_commands(options.module, program_args, options.num_processes, address)
  return run(commands, grace_s=options.grace_s)


def _split(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
  """The runner's flags, and the program's after `--`."""
  argv = list(argv)
  if '--' in argv:
    at = argv.index('--')
    return argv[:at], '--', argv[at + 1:]
  return argv, '', []


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
