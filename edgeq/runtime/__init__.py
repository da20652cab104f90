"""edgeq.runtime: load packed checkpoints zero-copy, run them through the int4 kernel (decode) and a dequantise +
bf16 GEMM path (prefill), a static KV cache from a byte budget, generation and an OpenAI-compatible server.

    from edgeq.runtime import load, generate, SamplingParams
    lm = load("out/", max_model_len=2048, kv_cache_bytes=256 << 20)
    print(generate(lm, "Once upon a time", SamplingParams(max_tokens=32)).text)
"""

from edgeq.runtime.generate import Generation, GenerationResult, SamplingParams, generate
from edgeq.runtime.loader import LayoutRepackWarning, LoadedModel, RuntimeSettings, load
from edgeq.runtime.repack import RepackReport, repack
from edgeq.runtime.sizes import parse_bytes

__all__ = ["load", "LoadedModel", "RuntimeSettings", "LayoutRepackWarning", "repack", "RepackReport", "generate",
           "Generation", "GenerationResult", "SamplingParams", "parse_bytes"]
