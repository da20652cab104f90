"""edgeq.runtime: load packed checkpoints zero-copy, run them through the int4 kernel (decode) and a dequantise +
bf16 GEMM path (prefill), a static KV cache from a byte budget, generation and an OpenAI-compatible server.

    from edgeq.runtime import load, generate, SamplingParams
    lm = load("out/", max_model_len=2048, kv_cache_bytes=256 << 20)
    print(generate(lm, "Once upon a time", SamplingParams(max_tokens=32)).text)
"""

import importlib

# Lazy: `edgeq.runtime.sizes` and friends must be importable without pulling in transformers (inspect, the CLI).
# The modules are named for what they hold (generation, repacker) so that no function shadows a module of its name.
_EXPORTS = {
    "load": "loader", "LoadedModel": "loader", "RuntimeSettings": "loader", "LayoutRepackWarning": "swap",
    "repack": "repacker", "RepackReport": "repacker", "generate": "generation", "Generation": "generation",
    "GenerationResult": "generation", "SamplingParams": "generation", "generate_ids": "generation", "parse_bytes": "sizes",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgeq.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"edgeq.runtime.{_EXPORTS[name]}"), name)
