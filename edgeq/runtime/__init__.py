"""edgeq.runtime: load packed checkpoints zero-copy, run them through the int4 kernel (decode) and a dequantise +
bf16 GEMM path (prefill), a static KV cache from a byte budget, generation and an OpenAI-compatible server.

    from edgeq.runtime import load, generate, SamplingParams
    lm = load("out/", max_model_len=2048, kv_cache_bytes=256 << 20)
    print(generate(lm, "Once upon a time", SamplingParams(max_tokens=32)).text)
"""

import importlib
import sys
import types

# Lazy: `edgeq.runtime.sizes` and friends must be importable without pulling in transformers (inspect, the CLI).
_EXPORTS = {
    "load": "loader", "LoadedModel": "loader", "RuntimeSettings": "loader", "LayoutRepackWarning": "loader",
    "repack": "repack", "RepackReport": "repack", "generate": "generate", "Generation": "generate",
    "GenerationResult": "generate", "SamplingParams": "generate", "generate_ids": "generate", "parse_bytes": "sizes",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgeq.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"edgeq.runtime.{_EXPORTS[name]}"), name)


class _Package(types.ModuleType):
    """Importing a submodule binds it as an attribute of its package. For ``generate`` and ``repack`` (a module and
    the function it exports, of the same name) that would make ``from edgeq.runtime import generate`` return the
    module once anything imported ``edgeq.runtime.generate``; the function is bound instead, as an eager
    ``from edgeq.runtime.generate import generate`` would. (``import edgeq.runtime.generate as m`` therefore gives
    the function; use ``from edgeq.runtime import generate as m`` style imports of the module's names.)"""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _EXPORTS and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
