"""`import mtp` turns on JAX's persistent compilation cache in the host's cache directory, and
leaves a directory the user chose alone. Each case runs in a fresh process: the choice is made
before JAX starts."""

import json
import os
import pathlib
import subprocess
import sys

from mtp import testing

# Prints JAX's cache directory after `import mtp` (imported before or after JAX, and with a
# directory chosen through jax.config first, as asked) and the cache hits of one compile.
_CHILD = r'''
import json, sys
order, chosen = sys.argv[1], sys.argv[2]
if order == 'jax_first':
  import jax
  if chosen:
    jax.config.update('jax_compilation_cache_dir', chosen)
import mtp
from mtp import compilation_cache
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith('/cache_hits') else None)
jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(5.0)).block_until_ready()
print(json.dumps({'dir': jax.config.jax_compilation_cache_dir, 'hits': len(hits),
                  'default': str(compilation_cache.default_directory())}))
'''


def _run(tmp_path: pathlib.Path, order: str = 'mtp_first', chosen: str = '', **variables):
  env = testing.child_env(MTP_CACHE_DIR=str(tmp_path / 'cache'),
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # The test session's own.
  env.update(variables)
  out = subprocess.run([sys.executable, '-c', _CHILD, order, chosen], env=env, check=True,
                       capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[1])
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled_from_the_host_cache(tmp_path):
  first = _run(tmp_path)
  directory = pathlib.Path(first['dir'])
  assert first['dir'] == first['default']
  assert directory.parent == tmp_path / 'cache' / 'jax'
  assert directory.name.startswith(os.uname().machine)
  assert first['hits'] == 0 and any(directory.iterdir())
  assert _run(tmp_path)['hits'] >= 1
  # Imported after JAX, with nothing chosen: the same directory, through jax.config.
  after_jax = _run(tmp_path, order='jax_first')
  assert after_jax['dir'] == first['dir'] and after_jax['hits'] >= 1


def test_a_directory_the_user_chose_is_kept(tmp_path):
  chosen = str(tmp_path / 'mine')
  assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=chosen)['dir'] == chosen
  assert _run(tmp_path, order='jax_first', chosen=chosen)['dir'] == chosen
  assert _run(tmp_path, JAX_ENABLE_COMPILATION_CACHE='false')['dir'] is None
  assert not (tmp_path / 'cache' / 'jax').exists()


def test_no_cache_where_the_host_cache_cannot_be_written(tmp_path):
  (tmp_path / 'cache').write_text('a file where the directory would be')
  assert _run(tmp_path)['dir'] is None


def test_importing_mtp_and_a_launchers_light_module_starts_no_jax(tmp_path):
  env = testing.child_env(MTP_CACHE_DIR=str(tmp_path / 'cache'))
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  code = ('import os, sys, mtp; from mtp.decode import decoders; '
          'print("jax" in sys.modules, bool(os.environ.get("JAX_COMPILATION_CACHE_DIR")))')
  out = subprocess.run([sys.executable, '-c', code], env=env, check=True, capture_output=True,
                       text=True, cwd=pathlib.Path(__file__).parents[1])
  assert out.stdout.split() == ['False', 'True']
