"""edgeq checkpoints for tests: quantised with the real `edgeq quantize` pipeline; the matching bf16 reference whose
Linear weights are the dequantised values; a synthetic Llama-shaped edgeq checkpoint with random packed bytes for the
memory test; a foreign (AVX2) layout; a digest of a directory's bytes to prove an input untouched.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgeq.layouts import tinygemm
from helpers.paths import FIXTURE


def dir_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _save(tensors: dict, out: Path, shards: int) -> dict:
    """Write tensors as one file or ``shards`` files plus an index; returns {file name: None}."""
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return {"model.safetensors": None}
    per = -(-len(names) // shards)
    weight_map, files = {}, {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per : (i + 1) * per]
        save_file({n: tensors[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        files[fname] = None
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def _copy_tokenizer(src: Path, out: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)


PINNED_RECIPE = Path(__file__).parent / "recipes" / "llama-pinned.toml"


def quantize(src: Path, out: Path, group_size: int = 32, method: str = "minmax", embeddings: str | None = None,
             recipe: str | None = None) -> Path:
    """The real `edgeq quantize` pipeline (edgeq.convert.pipeline); ``embeddings`` = --embeddings (None: the default,
    packed); ``recipe`` = --recipe (None: the family's)."""
    from edgeq.convert.pipeline import convert
    from edgeq.scheme import Scheme

    convert(src, out, Scheme.parse(f"w4a16-g{group_size}"), method=method, recipe=recipe, force=True, embeddings=embeddings)
    return out


def write_reference(qdir: Path, out: Path) -> Path:
    """A bf16 HF checkpoint equal to the edgeq checkpoint ``qdir`` with every quantised Linear replaced by its
    dequantised weight (unpacked with the manifest's layout) and a packed input embedding materialised as its bf16
    table E (helpers.embeddings.reference_table, the contract's formula): the reference the runtime must match."""
    from edgeq.io.mapped import MappedFiles
    from helpers.embeddings import reference_table

    manifest = json.loads((qdir / "edgeq_manifest.json").read_text())
    layout = tinygemm.TinygemmLayout.from_json(manifest["layout"])
    g = int(manifest["scheme"].rsplit("-g", 1)[1])
    files = MappedFiles(qdir)
    state = {}
    # a packed table's own levels are not Linears: E replaces them (a tied head's level 0 stays the head's Linear)
    levels = {lv["module"] for e in manifest.get("embeddings", {}).values() for lv in e["levels"]} - {manifest["head"]["name"]}
    for table in manifest.get("embeddings", {}):
        state[f"{table}.weight"] = reference_table(qdir)
    for name in files.names():
        if name.endswith(".scales_and_zeros") or name.rsplit(".", 1)[0] in levels:
            continue
        t = files.get(name)
        if name.endswith(".qweight"):
            m = name.removesuffix(".qweight")
            n, k = t.shape[0], t.shape[1] * 2
            gm = manifest.get("group_sizes", {}).get(m, g)  # a recipe's finer groups for this module
            state[f"{m}.weight"] = tinygemm.dequantize(tinygemm.unpack(t, n, k, layout), files.get(f"{m}.scales_and_zeros"), gm, torch.bfloat16)
        else:
            state[name] = t.clone()
    out.mkdir(parents=True, exist_ok=True)
    _save(state, out, 1)
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _copy_tokenizer(qdir, out)
    return out


def synthetic_checkpoint(out: Path, hidden: int = 1024, layers: int = 12, inter: int = 4096, vocab: int = 16384,
                         group_size: int = 128, seed: int = 0) -> dict:
    """A Llama-shaped edgeq checkpoint with random packed bytes (speed and memory do not depend on the values).
    Returns byte counts by category."""
    from transformers import AutoConfig

    layout = tinygemm.probe()
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, hd = hidden // 64, max(1, hidden // 256), 64
    shapes = {"self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv_heads * hd, hidden),
              "self_attn.v_proj": (kv_heads * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    tensors, modules = {}, []

    def add_q(name, n, k):
        tensors[f"{name}.qweight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        sz = torch.empty(k // group_size, n, 2)
        sz[..., 0] = 0.002
        sz[..., 1] = torch.randn(k // group_size, n, generator=gen) * 0.001
        tensors[f"{name}.scales_and_zeros"] = sz.to(torch.bfloat16)
        modules.append(name)

    for i in range(layers):
        for sub, (n, k) in shapes.items():
            add_q(f"model.layers.{i}.{sub}", n, k)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    add_q("lm_head", vocab, hidden)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    files = _save(tensors, out, 2)
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, vocab_size=vocab,
                               max_position_embeddings=4096, tie_word_embeddings=False).to_dict()
    cfg.update(dtype="bfloat16")
    cfg["quantization_config"] = {
        "quant_method": "edgeq", "format_version": 1, "scheme": f"w4a16-g{group_size}", "group_size": group_size,
        "method": "synthetic", "kernel": "tinygemm_w4a16", "layout": layout.fingerprint(), "head_quantized": True,
        "untied": False, "modules_not_converted": [],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    manifest = {"format_version": 1, "scheme": f"w4a16-g{group_size}", "method": "synthetic", "kernel": "tinygemm_w4a16",
                "layout": layout.to_json(), "head": {"name": "lm_head", "quantized": True, "source": "lm_head.weight", "untied": False},
                "quantized_modules": modules, "modules_not_converted": {}, "shards": files, "tensors": {}}
    (out / "edgeq_manifest.json").write_text(json.dumps(manifest, indent=1))
    packed = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith((".qweight", ".scales_and_zeros")))
    plain = sum(t.numel() * t.element_size() for n, t in tensors.items()) - packed
    return {"packed": packed, "unquantized": plain}


def avx2_like_layout() -> tinygemm.TinygemmLayout:
    """What the AVX2 path packs (32-row blocks of interleaved halves, adjacent-pair tails): a foreign layout here."""
    return tinygemm.TinygemmLayout(
        block_n=32, perms=((16, tuple(range(16))), (32, tuple(v for j in range(16) for v in (j, j + 16)))),
        torch_version=torch.__version__, cpu_capability="AVX2",
    )


def adjacent_layout(block_n: int) -> tinygemm.TinygemmLayout:
    """Blocks of `block_n` rows, every tail and block in natural order (no CPU packs this: foreign everywhere)."""
    return tinygemm.TinygemmLayout(block_n=block_n, perms=tuple((s, tuple(range(s))) for s in range(16, block_n + 1, 16)))


def foreign_layout() -> tinygemm.TinygemmLayout:
    """A layout this machine's kernel does not read: the AVX2 one, except on an AVX2 machine (a Zen 3, say), where
    that one is native and the adjacent 64-row layout stands in."""
    avx2 = avx2_like_layout()
    return adjacent_layout(64) if avx2.is_compatible(tinygemm.probe()) else avx2


_CACHE: dict[str, Path] = {}
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def prose_checkpoint(tmp_path_factory) -> Path:
    """The bundled trained fixture (Llama, tied head) quantised w4a16-g128 minmax, once per test session, with the
    pinned recipe (helpers/recipes/llama-pinned.toml) its greedy golden trajectories were recorded with."""
    if "prose" not in _CACHE:
        _CACHE["prose"] = quantize(FIXTURE, tmp_path_factory.mktemp("prose") / "q", group_size=128,
                                   recipe=str(PINNED_RECIPE))
    return _CACHE["prose"]


def with_chat_template(qdir: Path, out: Path) -> Path:
    """A copy of ``qdir`` whose tokenizer has a (tiny, made-up) chat template."""
    shutil.copytree(qdir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out
