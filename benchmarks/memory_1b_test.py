"""benchmarks.memory_1b: configs/llama_1b_mtp.py is ~1B parameters, its scaled-down train step
compiles on 8 simulated devices with the config's axis names, and the per-device state the
projection counts is what XLA assigns."""

import re

import jax
import pytest

from benchmarks import memory_1b
from configs import llama_1b_mtp
from mtp.parallel import mesh as mesh_lib


def test_the_config_is_about_a_billion_parameters_sharded_32_ways():
  config = llama_1b_mtp.get_config()
  full = memory_1b.projection(config, 32)
  assert 1.0e9 < full['num_params'] < 1.2e9
  assert full['rows_per_device'] * 32 == config.data.batch_size
  # float32 parameters split 32 ways (norm scales, replicated, are a rounding error).
  assert full['num_params'] * 4 / 32 <= full['params'] < full['num_params'] * 4 / 32 * 1.01
  assert full['optimizer_state'] == pytest.approx(2 * full['params'], rel=1e-3)  # Adam's moments
  assert full['activations']['total'] > 0
  with pytest.raises(mesh_lib.MeshError, match=r'batch_size \(256\) does not divide over the mesh'):
    memory_1b.projection(config, 24)


def test_scaled_down_step_compiles_and_its_state_is_the_projected_one():
  if jax.device_count() < 8:
    pytest.skip('needs 8 devices (conftest.py simulates them on CPU)')
  config = llama_1b_mtp.get_config()
  small = memory_1b.scaled_down(config, width_divisor=8, seq_divisor=16, num_devices=8, rows=2)
  assert small.model.num_layers == config.model.num_layers and small.model.scan_layers
  assert (small.data.batch_size, small.data.seq_len, small.model.embed_dim) == (16, 64, 256)
  mesh = mesh_lib.make_mesh(small.mesh)
  assert mesh.axis_names == mesh_lib.MESH_AXES and dict(mesh.shape)['fsdp'] == 8
  compiled = memory_1b.compile_train_step(small, mesh)
  measured = memory_1b.xla_memory(compiled)
  state = memory_1b.state_bytes_per_device(small, 8)
  batch = 3 * 2 * small.data.seq_len * 4  # tokens, positions, segment ids: int32, 2 rows each
  # The step's arguments are this device's shards of the train state and of the batch.
  assert measured['arguments'] == pytest.approx(
      state['params'] + state['optimizer_state'] + batch, rel=1e-3)
  assert measured['temporaries'] > 0
  # Each device computes its own 2 rows: no activation of all 16 at the model's width (256) or
  # the MLP's (1024), which splitting the matmuls over the FSDP-sharded weights' contraction
  # would leave on every device (`mesh_lib.constrain_batch`).
  hlo = compiled.as_text()
  assert re.search(r'\[(\d+,)*2,64,256\]', hlo)
  assert not re.search(r'\[(\d+,)*16,64,(256|1024)\]', hlo)


def test_a_divisor_that_does_not_divide_is_named():
  with pytest.raises(memory_1b.ScaleError, match='does not divide model.num_kv_heads'):
    memory_1b.scaled_down(llama_1b_mtp.get_config(), 16, 4, 8, 1)
