"""Reads `.safetensors` files into float32 numpy arrays, bfloat16 included, without torch.

The format is an 8-byte little-endian header size, a JSON header (name -> dtype, shape, byte
offsets into the data that follows) and the raw little-endian data. `safetensors.numpy` cannot
return bfloat16 tensors (numpy has no such dtype), and most Hugging Face checkpoints are bfloat16,
so the file is read here directly: with a memory map, checking every tensor's extent against the
file's size, so a truncated download is named rather than read past its end.
"""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from mtp.pretrained.llama import PretrainedError

_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
}
# Index tensors beside the weights (an EAGLE-3 drafter's d2t and t2d): kept as they are.
_INDEX_DTYPES = {
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
    'BOOL': np.bool_,
}


def read_header(path: pathlib.Path) -> tuple[dict, int]:
  """(name -> {dtype, shape, data_offsets}, offset of the data) of a safetensors file."""
  try:
    with open(path, 'rb') as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise PretrainedError(f'{path} is truncated: no safetensors header.')
      (size,) = struct.unpack('<Q', prefix)
      raw = f.read(size)
  except OSError as e:
    raise PretrainedError(f'{path} cannot be read ({e}).') from e
  if len(raw) < size:
    raise PretrainedError(f'{path} is truncated: its header needs {size} bytes, {len(raw)} remain.')
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise PretrainedError(f'{path} is not a safetensors file (bad header: {e}).') from e
  header.pop('__metadata__', None)
  return header, 8 + size


def read(path: str | pathlib.Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
  """Tensors of a safetensors file (only `names`, if given): weights as float32 arrays,
  integer and boolean (index) tensors in their own dtype."""
  path = pathlib.Path(path)
  header, start = read_header(path)
  available = path.stat().st_size - start
  data = np.memmap(path, np.uint8, 'r', offset=start) if available > 0 else np.zeros(0, np.uint8)
  out = {}
  for name, info in header.items():
    if names is not None and name not in names:
      continue
    dtype = _DTYPES.get(info.get('dtype')) or _INDEX_DTYPES.get(info.get('dtype'))
    if dtype is None:
      raise PretrainedError(f'{path}: tensor {name} has dtype {info.get("dtype")}; only '
                            f'{", ".join(_DTYPES)} weights (and {", ".join(_INDEX_DTYPES)} '
                            'index tensors) can be imported.')
    begin, end = info['data_offsets']
    shape = tuple(info['shape'])
    if end > available:
      raise PretrainedError(f'{path} is truncated: tensor {name} ends at byte {end} of the data, '
                            f'which has only {available} bytes.')
    if end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize:
      raise PretrainedError(f'{path}: tensor {name} has {end - begin} bytes for shape '
                            f'{list(shape)} of {info["dtype"]}.')
    values = data[begin:end].view(dtype).reshape(shape)  # Little-endian, as the host.
    # A copy, so the memory map can be closed.
    out[name] = values.astype(np.float32 if dtype in _DTYPES.values() else dtype)
  del data
  return out
