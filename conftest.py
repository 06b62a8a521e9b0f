"""Test session setup: 8 simulated CPU devices (before JAX starts), quiet library logs."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import tempfile  # noqa: E402

import jax  # noqa: E402

# Many tests compile the same small programs; a persistent cache shared by the session (and by
# xdist workers) compiles each once.
_CACHE = os.path.join(tempfile.gettempdir(), 'mtp-test-jax-cache')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
