"""GGUF files: reading them, converting them to a Hugging Face folder, keeping their quantized blocks.

This package's own module is torch-free, so that finding an already converted folder
(`atom_core.engine.fetch`) does not import torch.
"""

# A GGUF file's quantized blocks, kept beside a converted folder's float weights for
# `quantization="auto"` (atom_core/layers/quantized_weight.py); not a checkpoint shard.
GGUF_BLOCKS_FILE = "gguf_blocks.safetensors"
