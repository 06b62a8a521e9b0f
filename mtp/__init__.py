"""mtp: multi-token prediction training and exact self-speculative decoding in JAX."""

from mtp.api import Generation, LoadedModel, generate, load

__version__ = '0.1.0'
__all__ = ['Generation', 'LoadedModel', 'generate', 'load']
