"""mtp: multi-token prediction training and exact self-speculative decoding in JAX.

`mtp.load`, `mtp.generate` and `mtp.chat` are imported on first use, so that importing a light
submodule (`mtp.decode.decoders`, for a launcher's flags) does not start JAX.
"""

__version__ = '0.1.0'
__all__ = ['Generation', 'LoadedModel', 'chat', 'generate', 'load']


def __getattr__(name):
  if name in __all__:
    from mtp import api
    return getattr(api, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
