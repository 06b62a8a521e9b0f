"""Export a trained workdir for serving.

Formats (`python -m launch.export --format=...`):
  params      a param-only Orbax checkpoint with config.json and the tokenizer (`params.py`);
  hf          a Hugging Face Llama directory, heads in their serving systems' formats (`hf.py`);
  jax_export  the whole generate function serialized with `jax.export` (`jax_artifact.py`).

`writer.export` checks, stages and renames every format; `manifest.py` is the `export.json`
each export carries; `runtime.py` runs a jax_export directory without the model code.
"""


class ExportError(ValueError):
  """An export that cannot be made; the message names the workdir, format or option at fault."""
