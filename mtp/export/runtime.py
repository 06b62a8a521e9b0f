"""Runs a jax_export directory: deserialize the programs, call them. No model code.

This module imports JAX, numpy, safetensors, the tokenizer, the paths helpers
(`checkpoint/paths.py`, etils.epath: the directory may be on an object store), the tree helpers
(`decode/trees.py`, plain numpy), the decoders' registry (`decode/decoders.py`) and the finish
reasons (`decode/finish.py`), never `mtp.model` nor the decode loop: what runs is the StableHLO
in the `*.jax_exported` files (`jax_artifact.py` documents their contract).

`load(directory)` reads the manifest, the tokenizer and the parameters (placed on the device
once), and deserializes every program; `LoadedArtifact.program(...)` picks the program that
serves a request or raises `ArtifactMismatchError` saying what the artifact can serve;
`Program.run(...)` decodes a batch. The first call of a program at a new batch size or prompt
width compiles it (`Program.first_call_seconds` keeps the first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from etils import epath
import jax
import ml_collections
import numpy as np

from mtp.checkpoint import paths
from mtp.data import tokenizer as tokenizer_lib
from mtp.decode import decoders as decoders_lib
from mtp.decode import finish
from mtp.decode import trees as trees_lib
from mtp.export import manifest as manifest_lib

FORMAT = 'jax_export'


class ArtifactMismatchError(ValueError):
  """The request asks for something the artifact did not bake in (the message lists what it
  can serve and how to export one that serves the request)."""


@dataclasses.dataclass
class Result:
  """A decoded batch, on the host (the fields of `decode.state.DecodeResult`)."""
  tokens: np.ndarray
  num_generated: np.ndarray
  num_steps: np.ndarray
  accepted_histogram: np.ndarray
  reason: np.ndarray
  logprobs: None = None
  top_ids: None = None
  top_logprobs: None = None

  def finish_reason(self, row: int) -> str | None:
    return finish.finish_reason(self.reason[row])

  @property
  def mean_accepted(self) -> np.ndarray:
    """[B] tokens emitted per loop step (0 for a row that needed no loop step)."""
    counts = np.arange(self.accepted_histogram.shape[-1], dtype=np.float32)
    emitted = (self.accepted_histogram * counts).sum(-1)
    return emitted / np.maximum(self.num_steps, 1).astype(np.float32)


@dataclasses.dataclass
class Program:
  """One exported generate function and the settings baked into it (manifest record)."""
  record: dict[str, Any]
  exported: Any  # jax.export.Exported
  first_call_seconds: float | None = None

  def __post_init__(self):
    # One jitted caller: `Exported.call` alone traces its wrapper again on every call.
    self._call = jax.jit(self.exported.call)

  @property
  def decoder(self) -> str:
    return self.record['decoder']

  def run(self, params: dict, prompts: np.ndarray, lengths: np.ndarray, *, key,
          max_new_tokens: int, eos_id: int | None, pad_id: int, first_row: int = 0) -> Result:
    """Decodes [B, P] right-padded int32 prompts with per-row `lengths` [B]; row r samples
    with `key` folded by `first_row + r` (its prompt's index in the request)."""
    start = time.perf_counter()
    prompts = np.asarray(prompts, np.int32)
    chunk = int(self.record.get('prompt_chunk', 1))  # Its prompts' width is a multiple of it.
    width = -(-prompts.shape[1] // chunk) * chunk
    prompts = np.pad(prompts, ((0, 0), (0, width - prompts.shape[1])))
    out = self._call(params, prompts, np.asarray(lengths, np.int32), key,
                     np.int32(-1 if eos_id is None else eos_id), np.int32(pad_id),
                     np.int32(max_new_tokens), np.int32(first_row))
    out = jax.device_get(out)
    if self.first_call_seconds is None:
      self.first_call_seconds = time.perf_counter() - start
    return Result(tokens=out['tokens'], num_generated=out['num_generated'],
                  num_steps=out['num_steps'], accepted_histogram=out['accepted_histogram'],
                  reason=out['reason'])


@dataclasses.dataclass
class LoadedArtifact:
  """A jax_export directory, loaded: what `mtp.load` returns for one.

  Attributes:
    tokenizer, config, step, workdir: as `checkpoint.loading.LoadedModel`'s (workdir: the
      export, absolute or a URL).
    manifest: `export.json`.
    params: {name: device array}, the programs' first argument.
    programs: every program of the artifact.
    load_seconds: reading and deserializing everything (no compilation).
  """
  tokenizer: tokenizer_lib.Tokenizer
  config: ml_collections.ConfigDict
  step: int
  workdir: epath.Path
  manifest: dict[str, Any]
  params: dict[str, jax.Array]
  programs: list[Program]
  load_seconds: float

  @property
  def artifact(self) -> dict[str, Any]:
    return self.manifest[FORMAT]

  @property
  def max_new_tokens(self) -> int:
    return int(self.artifact['max_new_tokens'])

  @property
  def max_seq_len(self) -> int:
    return int(self.artifact['max_seq_len'])

  @property
  def vocab_size(self) -> int:
    return int(self.artifact['vocab_size'])

  @property
  def decoders(self) -> tuple[str, ...]:
    """The decoders its programs run ('autoregressive', and 'speculative' with heads)."""
    return tuple(dict.fromkeys(p.decoder for p in self.programs))

  def key(self, seed: int):
    """The raw key data of a request's `seed` that a program takes, as `mtp.generate` derives
    it (`decode.settings`: the seed modulo 2**64, its low and high 32 bits); the program folds
    in each row's index."""
    seed = int(seed) % 2 ** 64
    key = jax.random.key(seed & 0xFFFFFFFF, impl=self.artifact['prng_impl'])
    return jax.random.key_data(jax.random.fold_in(key, seed >> 32))

  def program(self, decoder: str, *, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, tree=None, lookup: int = 0,
              max_new_tokens: int | None = None) -> Program:
    """The program that serves these settings.

    `decoder` is a name of `decoders.NAMES`; an adaptive one ('auto') runs the artifact's
    speculative program (an exported loop holds no fallback to one-token steps), or its
    autoregressive one for a model without heads. `tree` None and `lookup` 0 take the
    program's own; given, they must be the ones it was exported with (a static name of
    `trees.NAMES`, choices or a `trees.Tree`).

    Raises:
      ValueError: an unknown decoder, or a tree or lookup for one that does not draft.
      ArtifactMismatchError: no program serves them (the message lists what the artifact
        serves).
    """
    spec = decoders_lib.get(decoder)
    if not spec.drafts and (tree is not None or lookup):
      drafting = ', '.join(d.name for d in decoders_lib.DECODERS.values() if d.drafts)
      raise ValueError(f'tree and lookup apply to the drafting decoders ({drafting}) only, '
                       f'not to {decoder!r}')
    if spec.adaptive:
      decoder = 'speculative' if 'speculative' in self.decoders else 'autoregressive'
    if max_new_tokens is not None and max_new_tokens > self.max_new_tokens:
      raise ArtifactMismatchError(
          f'max_new_tokens {max_new_tokens} exceeds the {self.max_new_tokens} this artifact '
          f'was exported for ({self.workdir}); export again with a larger max_new_tokens')
    want = (decoder, float(temperature), int(top_k) if temperature else 0,
            float(top_p) if temperature else 1.0)
    matches = [p for p in self.programs if self._settings(p.record) == want]
    if not matches:
      raise ArtifactMismatchError(
          f'{self.workdir} holds no {decoder} program for temperature={temperature}, '
          f'top_k={top_k}, top_p={top_p}; it serves {self._listing()}. Export again with '
          '--temperature/--top_k/--top_p for sampling')
    program = matches[0]
    if program.record['tree'] is not None:
      self._check_tree(program, tree, lookup)
    return program

  @staticmethod
  def _settings(record: dict) -> tuple:
    return (record['decoder'], float(record['temperature']), int(record['top_k']),
            float(record['top_p']))

  def _listing(self) -> str:
    return '; '.join(
        f'{p.decoder} ' + ('greedy' if not p.record['temperature'] else
                           f'temperature={p.record["temperature"]}, top_k={p.record["top_k"]}, '
                           f'top_p={p.record["top_p"]}') for p in self.programs)

  def _check_tree(self, program: Program, tree, lookup: int) -> None:
    baked = {tuple(c) for c in program.record['tree']}
    if tree is not None:
      asked = _choices(tree, int(self.config.model.mtp_num_heads))
      if asked != baked:
        raise ArtifactMismatchError(
            f'the tree {sorted(asked)} is not the one {self.workdir} was exported with '
            f'({sorted(baked)}); leave tree unset to use it, or export again with this tree')
    if lookup and lookup != program.record['lookup']:
      raise ArtifactMismatchError(
          f'lookup={lookup}: {self.workdir}\'s {program.decoder} program drafts '
          f'{program.record["lookup"]} tokens by prompt lookup; leave lookup at 0 to use it, '
          'or export again with this lookup')


def _choices(tree, num_heads: int) -> set[tuple[int, ...]]:
  """A tree option as the set of its Medusa-style paths."""
  if isinstance(tree, str) and tree in trees_lib.MEASURED:
    raise ArtifactMismatchError(
        f'tree={tree!r} cannot be used with an exported artifact (it measures the model); '
        "leave it unset to use the artifact's tree")
  try:
    return set(trees_lib.static_tree(tree, num_heads).choices)
  except ValueError as e:
    raise ArtifactMismatchError(str(e)) from None


def is_artifact(directory: str | os.PathLike) -> bool:
  """Whether `directory` is a jax_export directory (its manifest says so)."""
  record = manifest_lib.read(directory)
  return record is not None and record['format'] == FORMAT


def load(directory: str | os.PathLike, device: jax.Device | None = None) -> LoadedArtifact:
  """Loads a jax_export directory: manifest, tokenizer, parameters, programs.

  `directory` may be a URL (`gs://bucket/export`): its files are read through etils.epath,
  the parameters from a local copy (`paths.local_copy`, fetched once per host), as
  safetensors reads local files only.

  Raises:
    ValueError: it is not a jax_export directory, or a file is missing or corrupt (named).
  """
  from safetensors import numpy as safetensors_numpy  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  directory = paths.as_path(directory)
  manifest = manifest_lib.read(directory)
  if manifest is None or manifest['format'] != FORMAT:
    raise ValueError(f'{directory} is not a jax_export directory (its {manifest_lib.FILENAME} '
                     'is missing or names another format)')
  artifact = manifest[FORMAT]
  tokenizer = tokenizer_lib.Tokenizer.load(directory)
  config = ml_collections.ConfigDict(json.loads((directory / 'config.json').read_text()))
  params_path = directory / artifact['params']['file']
  try:
    arrays = safetensors_numpy.load_file(str(paths.local_copy(params_path)))
  except Exception as e:  # pylint: disable=broad-except  # safetensors raises its own types.
    raise ValueError(f'{params_path} is missing or corrupt ({type(e).__name__}: {e})') from e
  device = device or jax.devices()[0]
  params = {name: jax.device_put(value, device) for name, value in arrays.items()}
  programs = []
  for record in artifact['programs']:
    path = directory / record['file']
    try:
      exported = jax.export.deserialize(bytearray(path.read_bytes()))
    except OSError as e:
      raise ValueError(f'{path} cannot be read ({e})') from e
    except Exception as e:  # pylint: disable=broad-except  # flatbuffers' own errors.
      raise ValueError(f'{path} is corrupt ({type(e).__name__}: {e})') from e
    programs.append(Program(record=record, exported=exported))
  return LoadedArtifact(tokenizer=tokenizer, config=config, step=int(manifest['step']),
                        workdir=directory, manifest=manifest, params=params,
                        programs=programs, load_seconds=time.perf_counter() - start)
