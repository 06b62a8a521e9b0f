"""mtp: multi-token prediction training and exact self-speculative decoding in JAX.

`mtp.load`, `mtp.generate` and `mtp.chat` are imported on first use, so that importing a light
submodule (`mtp.decode.decoders`, for a launcher's flags) does not start JAX. Importing `mtp`
turns on JAX's persistent compilation cache where the user has not chosen one
(`mtp.compilation_cache`): later processes on this host load what earlier ones compiled.
"""

from mtp import compilation_cache

compilation_cache.enable()

__version__ = '0.1.0'
__all__ = ['Generation', 'LoadedModel', 'chat', 'generate', 'load']


def __getattr__(name):
  if name in __all__:
    from mtp import api
    return getattr(api, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
