"""A synthetic HF checkpoint (benchmarks/synthetic.py) -> GGUF F16 -> llama.cpp Q4_K_M, for the llama.cpp arm.

Needs the optional extras ``gguf`` (writes the F16 file) and ``llama-cpp-python`` (its ``llama_model_quantize`` is
llama-quantize). llama.cpp's own converter (convert_hf_to_gguf.py) needs the model's tokenizer files, which synthetic
checkpoints do not have, so this writes the GGUF itself from the same safetensors:

- hyperparameters from config.json under llama.cpp's keys for the ``llama`` / ``qwen2`` architectures;
- tensors renamed to llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ...), 2-D weights F16, 1-D (norms,
  biases) F32; a tied head is left out, as the converter does (llama.cpp then uses ``token_embd``, and Q4_K_M stores
  it as Q6_K);
- a stand-in SentencePiece vocabulary of ``vocab_size`` tokens (``<unk> <s> </s>``, 256 byte tokens, then ``t<i>``):
  the benchmark feeds token ids, never text.

Not reproduced: the Q/K row permutation llama.cpp's converter applies to ``llama`` checkpoints, and Llama-3's rope
scaling factors. Both change the values computed, not the work done; the weights are random anyway.

    python benchmarks/gguf_synthetic.py /tmp/edgeq-e2e/llama-3.2-1b-bf16 /tmp/llama-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

NAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
]
ARCH = {"llama": "llama", "qwen2": "qwen2"}
Q4_K_M = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def gguf_name(hf: str) -> str:
    for pattern, repl in NAMES:
        if re.fullmatch(pattern, hf):
            return re.sub(pattern, repl, hf)
    raise ValueError(f"{hf}: no llama.cpp name for this tensor")


def vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE...
    tokens += [f"t{i}" for i in range(len(tokens), n)]
    types += [1] * (n - len(types))  # NORMAL
    return tokens[:n], [0.0] * n, types[:n]


def write_f16(src: Path, out: Path) -> Path:
    """Write ``out`` (GGUF, F16 weights) from the bf16 safetensors checkpoint ``src``; streamed tensor by tensor."""
    import gguf
    import numpy as np

    from edgeq.io.hf import open_checkpoint

    cfg = json.loads((src / "config.json").read_text())
    arch = ARCH.get(cfg["model_type"])
    if arch is None:
        raise SystemExit(f"{src}: model_type {cfg['model_type']!r} is not one this script maps ({', '.join(ARCH)})")
    ckpt = open_checkpoint(src)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"synthetic {src.name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(1)  # MOSTLY_F16
    w.add_vocab_size(cfg["vocab_size"])
    tokens, scores, types = vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = [n for n in ckpt.tensors if not n.endswith("rotary_emb.inv_freq")]
    for name in names:
        info = ckpt.tensors[name]
        dtype = np.float16 if len(info.shape) == 2 else np.float32
        numel = 1
        for d in info.shape:
            numel *= d
        w.add_tensor_info(gguf_name(name), info.shape, np.dtype(dtype), numel * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in names:
        t = ckpt.read(name).float()
        w.write_tensor_data(t.numpy().astype(np.float16 if t.dim() == 2 else np.float32))
    w.close()
    return out


def quantize(f16: Path, out: Path, threads: int = 2, ftype: int = Q4_K_M) -> Path:
    """llama-quantize through llama-cpp-python's binding of ``llama_model_quantize``."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = L.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({f16} -> {out}) returned {rc}")
    return out


def build_q4_k_m(src: Path, out: Path, threads: int = 2, keep_f16: bool = False) -> Path:
    f16 = out.with_name(out.stem + ".F16.gguf")
    t0 = time.perf_counter()
    write_f16(src, f16)
    t1 = time.perf_counter()
    quantize(f16, out, threads)
    print(f"{out}: F16 written in {t1 - t0:.0f} s, Q4_K_M in {time.perf_counter() - t1:.0f} s, "
          f"{out.stat().st_size / 2**20:.0f} MiB")
    if not keep_f16:
        f16.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path, help="synthetic bf16 HF checkpoint (benchmarks/synthetic.py)")
    ap.add_argument("out", type=Path, help="output .gguf (Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    build_q4_k_m(args.src, args.out, args.threads, args.keep_f16)


if __name__ == "__main__":
    main()
