"""JAX's persistent compilation cache, on by default in this host's cache directory.

A process pays for compiling what it runs before it runs it: SmolLM2 with its EAGLE-3 drafter
(`auto`, bfloat16, 2 CPU cores) spent 27 s of its first 41 s call compiling. JAX can keep
compiled programs on disk, keyed by the program and the compiler, so every later process on the
host loads them instead (that call then took 13 s: tracing and lowering remain, they make the
key). `import mtp` points JAX there, at `<host cache>/jax/<machine>`
(`host_cache.root()`: `$MTP_CACHE_DIR` or ~/.cache/mtp), unless the user chose:
`JAX_COMPILATION_CACHE_DIR` or `jax_compilation_cache_dir` set, or the cache switched off with
`JAX_ENABLE_COMPILATION_CACHE=false`. JAX stores only programs that took a second or more to
compile (`jax_persistent_cache_min_compile_time_secs`).

`<machine>` names the CPU's model and instruction set: XLA:CPU compiles for the host's vector
extensions and refuses a program compiled for others, so a home directory shared by hosts of
several CPU kinds keeps one cache per kind. Known: on some Intel CPUs (Cascade Lake) the CPU
loader of JAX 0.9-0.10 refuses every cached program (jax-ml/jax#38445), logging a line and
compiling it again; `JAX_ENABLE_COMPILATION_CACHE=false` turns the cache off there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import sys

from mtp.checkpoint import host_cache

ENV_DIR = 'JAX_COMPILATION_CACHE_DIR'
ENV_ENABLE = 'JAX_ENABLE_COMPILATION_CACHE'
_FALSE = ('0', 'false', 'f', 'no', 'n', 'off')  # As JAX reads a boolean variable.


def machine_key() -> str:
  """The machine's architecture and a digest of its CPU's model and flags, e.g.
  'x86_64-1f3a9c0e2b7d': what XLA:CPU compiles for."""
  model, flags = '', ''
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as cpuinfo:
      for line in cpuinfo:  # The first processor's fields are every processor's.
        name, _, value = line.partition(':')
        if name.strip() == 'model name':
          model = value.strip()
        elif name.strip() in ('flags', 'Features'):  # x86; ARM.
          flags = ' '.join(sorted(value.split()))
        elif not line.strip():
          break
  except OSError:  # No /proc: macOS, where the processor's name is what there is.
    model = platform.processor()
  digest = hashlib.sha1(f'{model}|{flags}'.encode()).hexdigest()[:12]
  return f'{platform.machine() or "unknown"}-{digest}'


def default_directory() -> pathlib.Path:
  """Where `enable` points JAX: `<host cache>/jax/<machine_key()>`."""
  return host_cache.root() / 'jax' / machine_key()


def enable() -> str | None:
  """Points JAX's persistent compilation cache at `default_directory()` where nobody chose a
  directory; before JAX is imported through the environment (processes this one starts
  inherit it), after through `jax.config`. Returns the directory set, or None: one was chosen
  already, the cache is switched off, or the default cannot be written (JAX would warn at
  every compile)."""
  if os.environ.get(ENV_DIR) or os.environ.get(ENV_ENABLE, '').lower() in _FALSE:
    return None
  jax = sys.modules.get('jax')
  if jax is not None and (jax.config.jax_compilation_cache_dir is not None
                          or not jax.config.jax_enable_compilation_cache):
    return None
  directory = default_directory()
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    logging.info('No persistent compilation cache: %s cannot be created (%s).', directory, e)
    return None
  if not os.access(directory, os.W_OK | os.X_OK):
    logging.info('No persistent compilation cache: %s is not writable.', directory)
    return None
  if jax is None:
    os.environ[ENV_DIR] = str(directory)
  else:
    jax.config.update('jax_compilation_cache_dir', str(directory))
  return str(directory)
