"""Loading a trained model to run it: `load(workdir)` -> `LoadedModel`.

A training workdir (or a params export, which loads like one) gives the model with its
tokenizer, config and step; a jax_export directory gives a `runtime.LoadedArtifact` (its
programs, no model). Decoding, serving and export all load through here (`mtp.load` is this
`load`), below them all.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import ml_collections
from etils import epath
from flax import nnx

from mtp.checkpoint import checkpointing
from mtp.checkpoint import fingerprint
from mtp.checkpoint import paths
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import state as state_lib
from mtp.export import manifest as manifest_lib
from mtp.model import mtp_model


@dataclasses.dataclass
class LoadedModel:
  """A trained model with what it needs to run: tokenizer, config, provenance."""
  model: mtp_model.MTPModel
  tokenizer: tokenizer_lib.Tokenizer
  config: ml_collections.ConfigDict
  step: int
  workdir: epath.Path
  # What `_derive` made from the weights, by name, and the weight arrays they all came from.
  _derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                     compare=False)
  _derived_from: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

  def prepared(self) -> state_lib.PreparedModel:
    """`model` prepared for decoding (`state.prepare`: on CPU a copy with fused projections),
    made once and kept while `model` holds the same weight arrays; a new model or a replaced
    weight prepares again. (Preparing SmolLM2 copies about 280 MB of projections.)"""
    return self._derive('prepared', state_lib.prepare)

  def weight_fingerprints(self) -> dict[str, list]:
    """`fingerprint.fingerprints` of `model`'s weights, computed once while it holds the same
    weight arrays (reading all of SmolLM2's takes 0.2-0.7 s; decoding with `auto` keys its
    measurements by them on every call)."""
    return self._derive('fingerprints', lambda model: fingerprint.fingerprints(
        nnx.state(model)))

  def engines(self) -> dict:
    """Decoders resolved for `model`'s weights, kept between `mtp.generate` calls by decoder,
    options and shape bucket (`decode.buckets`); dropped with the weights they decode."""
    return self._derive('engines', lambda model: {})

  def _derive(self, name: str, make):
    """make(model), kept until `model` holds other weight arrays (jax arrays are immutable,
    so the same arrays are the same weights); then everything derived is dropped, so no old
    weights stay alive through it."""
    leaves = tuple(jax.tree.leaves(nnx.state(self.model)))
    if (len(leaves) != len(self._derived_from)
        or any(a is not b for a, b in zip(leaves, self._derived_from))):
      self._derived.clear()
      self._derived_from = leaves
    if name not in self._derived:
      self._derived[name] = make(self.model)
    return self._derived[name]


DTYPES = ('float32', 'bfloat16')


def load(workdir: str | os.PathLike, step: int | None = None,
         device: jax.Device | None = None, scan_layers: bool | None = None,
         dtype: str | None = None) -> LoadedModel | 'runtime.LoadedArtifact':
  """Loads the parameters of the latest (or the given) checkpoint of a training workdir.

  `workdir` may also be an export directory (`launch.export`): a params export loads as a
  workdir; a jax_export one as a `'runtime.LoadedArtifact'` (its programs, no model).

  The trunk's layers load in the layout `scan_layers` asks for (default: the config's
  `model.scan_layers`), whichever layout the checkpoint holds (`mtp.model.layout`); the returned
  config says which. `dtype` ('float32' | 'bfloat16'; default the config's) sets the weights'
  and activations' precision (`model.param_dtype` and `model.dtype` of the returned config):
  'bfloat16' halves the weights' bytes; on XLA:CPU a one-token step costs about 1.2x
  float32's, but verifying 8 tokens costs about 1.2x one token, against 2x in float32
  (`mtp.model.products`). Decoders stay exact against the loaded model's own autoregressive
  decoding in its precision, bit for bit.

  Raises:
    checkpointing.CheckpointError: the workdir, its config, tokenizer or checkpoint is missing
      or unreadable (the message names which).
    ValueError: the tokenizer file is corrupt, or the directory is an export that `mtp` does
      not run (the message names it).
  """
  from mtp.export import runtime  # pylint: disable=import-outside-toplevel  # Exports only.
  workdir = paths.as_path(workdir)  # Local, or on an object store (gs://...).
  exported = manifest_lib.read(workdir)
  if exported is not None and exported['format'] == runtime.FORMAT:
    artifact = runtime.load(workdir, device=device)
    if step is not None and step != artifact.step:
      raise checkpointing.CheckpointError(
          f'{workdir} is a jax_export of step {artifact.step}, not of step {step}.')
    return artifact
  if exported is not None and exported['format'] != 'params':
    raise ValueError(f'{workdir} is an export in the {exported["format"]} format, which mtp '
                     'does not run: load the training workdir, or a params or jax_export export')
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f'dtype must be one of {", ".join(DTYPES)}, got {dtype!r}')
  config = checkpointing.load_config(workdir)
  if not (workdir / tokenizer_lib.FILENAME).exists():
    raise checkpointing.CheckpointError(f'{workdir / tokenizer_lib.FILENAME} does not exist.')
  tokenizer = tokenizer_lib.Tokenizer.load(workdir)
  if scan_layers is not None:
    with config.unlocked():
      config.model.scan_layers = bool(scan_layers)
  model_config = mtp_model.ModelConfig.from_config(config.model)
  abstract = nnx.eval_shape(lambda: mtp_model.MTPModel(model_config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract)
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        abstract_params)
  # A heads-only workdir's trunk comes from its base workdir (base.json): restore_params knows.
  params, step = checkpointing.restore_params(workdir, target, step=step)
  if dtype is not None and (dtype, dtype) != (config.model.dtype, config.model.param_dtype):
    with config.unlocked():
      config.model.dtype = config.model.param_dtype = dtype
    graphdef, params = mtp_model.in_precision(model_config, params, dtype)
  return LoadedModel(model=nnx.merge(graphdef, params), tokenizer=tokenizer, config=config,
                     step=step, workdir=workdir)
