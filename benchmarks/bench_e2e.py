"""End to end: synthetic checkpoints of real model shapes -> edgeq quantize -> edgeq bench, w4a16-g128 against the
bf16 reference (and llama.cpp Q4_K_M when llama-cpp-python and gguf are installed). Prints the markdown tables of
docs/results.md: decode and prefill with spread, memory ledger, projection vs measured, conversion time and peak.

    python benchmarks/bench_e2e.py                                  # both shapes, 3 passes, 2 threads, pp512 tg128
    python benchmarks/bench_e2e.py --models llama-3.2-1b --passes 3 --workdir /tmp/edgeq-e2e --json e2e.json
    python benchmarks/bench_e2e.py --no-gguf                         # skip the llama.cpp arm

Checkpoints are built once in --workdir and reused (delete it to rebuild). Weights are random (speed and memory do
not depend on the values). Every arm runs through `edgeq.bench.run.run_bench`: fresh process per pass, arms interleaved,
failures suppress the comparison (docs/methodology.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's edgeq, whatever pip points at
from synthetic import SHAPES, write  # noqa: E402

from edgeq import cpu  # noqa: E402
from edgeq.bench.conversion import run_convert  # noqa: E402
from edgeq.bench.records import Arm, BenchConfig  # noqa: E402
from edgeq.bench.render import fmt_stat, to_json  # noqa: E402
from edgeq.bench.schedule import run_bench  # noqa: E402
from edgeq.bench.summary import compare  # noqa: E402
from edgeq.runtime.crossover import phrase as crossover_phrase  # noqa: E402


MODELS = ("qwen2.5-1.5b", "llama-3.2-1b")
SCHEME = "w4a16-g128"
# The quick conversion (least-squares rounding, the family recipe): every table of README/docs/results.md from this
# script is of its checkpoints. Since 2026-12-05 the plain `edgeq quantize` (and `--scheme` alone) takes the quality
# recipe with GPTQ instead, ~8-20x longer on a 1B model on 2 cores; its checkpoint's serving cost was measured apart
# (`edgeq bench QUALITY --vs RTN`, docs/results.md "what the `quality` recipe's checkpoint costs to serve").
METHOD = "rtn"
SCHEME_W4A8 = "w4a8-g128"
NAMES = {"A": SCHEME, "W": SCHEME_W4A8, "B": "bf16 reference", "G": "llama.cpp Q4_K_M"}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gguf_possible() -> str | None:
    """None when a Q4_K_M GGUF can be built and run here, else why not."""
    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install llama-cpp-python gguf)"
    return None


def prepare(model: str, workdir: Path, want_gguf: bool, schemes=(SCHEME,)) -> dict:
    src = workdir / f"{model}-bf16"
    if not (src / "config.json").exists():
        log(f"{model}: writing the synthetic bf16 checkpoint")
        write(dict(SHAPES[model]), src)
    out = {}
    for scheme in schemes:
        q = workdir / f"{model}-{scheme}"
        saved = workdir / (f"{model}-convert.json" if scheme == SCHEME else f"{model}-{scheme}-convert.json")
        conversion = None
        if not (q / "edgeq_manifest.json").exists():
            log(f"{model}: edgeq quantize --scheme {scheme} --method {METHOD} (child process, timed)")
            conversion = run_convert(str(src), scheme, METHOD, passes=1, keep=q)
            if conversion.failures:
                raise SystemExit(f"{model}: conversion failed: {conversion.failures}")
            saved.write_text(to_json(conversion))
        elif saved.exists():
            conversion = json.loads(saved.read_text())
        out[scheme] = (q, conversion)
    gguf = None
    if want_gguf:
        from gguf_synthetic import build_q4_k_m  # noqa: PLC0415 - optional extra

        gguf = workdir / f"{model}-Q4_K_M.gguf"
        if not gguf.exists():
            log(f"{model}: writing GGUF F16 and quantising to Q4_K_M with llama.cpp")
            build_q4_k_m(src, gguf, threads=2)
    return {"src": src, "quantized": out[SCHEME][0], "gguf": gguf, "conversion": out[SCHEME][1],
            "w4a8": out.get(SCHEME_W4A8, (None, None))[0], "conversion_w4a8": out.get(SCHEME_W4A8, (None, None))[1]}


def refresh_page_cache(ckpt: Path) -> None:
    """Evict a checkpoint's shards from the page cache and read them back through a MADV_HUGEPAGE mapping (what
    edgeq's loader advises): the page cache as a load after a reboot finds it, in 2 MiB folios where the kernel can
    (a fresh conversion's depend on free memory while it wrote: docs/runtime.md, "Huge pages")."""
    import mmap
    import os

    for shard in sorted(ckpt.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be evicted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_HUGEPAGE)
                m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
        finally:
            os.close(fd)
    log(f"{ckpt.name}: page cache read back through a MADV_HUGEPAGE mapping")


def _conv_row(model: str, c, scheme: str = SCHEME) -> str:
    if c is None:
        return f"| {model} | {scheme}: (converted earlier, not measured) | | | |"
    if not isinstance(c, dict):
        c = json.loads(to_json(c))
    s, p = c["seconds"], c["peak_rss"]
    return (f"| {model} | {scheme}: {mib(c['bytes_in'])} -> {mib(c['bytes_out'])} | {s['median']:.0f} s | {mib(p['median'])} | "
            f"{mib(c['peak_anon']['median'])} |")


def markdown(results: list[tuple[str, dict, object]], args, machine: dict) -> str:
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores ({', '.join(machine['flags'])}), "
        f"{machine['memory_bytes'] / 2**30:.0f} GiB; threads {args.threads}; {machine['date']}; load average "
        f"{machine['loadavg_start'][0]:.1f} at the start. edgeq bench: "
        f"{args.passes} passes per arm, each a fresh process, arms interleaved; prompt {args.prompt_len} tokens, "
        f"{args.gen_len} generated; median [min-max].",
        "",
        "| model | arm | prefill pp{} tok/s | decode tg{} tok/s | TTFT s | load s | CPU share pp/tg |".format(
            args.prompt_len, args.gen_len),
        "|---|---|---|---|---|---|---|",
    ]
    for model, prep, report in results:
        if not report.ok:
            lines.append(f"| {model} | FAILED: {report.failures[0]['error'][:120]} | | | | |")
            continue
        for s in report.arms:
            name = NAMES[s.label]
            t = s.timing
            share = "/".join(f"{t[k].median:.0%}" for k in ("cpu_share_prefill", "cpu_share_decode") if k in t)
            lines.append(f"| {model} | {name} | {fmt_stat(t['pp_tok_s'], 'tok/s')} | {fmt_stat(t['tg_tok_s'], 'tok/s')} "
                         f"| {fmt_stat(t['ttft_s'], 's')} | {fmt_stat(t['load_s'], 's')} | {share or 'n/a'} |")
    lines += ["", "Ratios of medians (edgeq arm / other, from the same interleaved run; > 1 means the edgeq arm is "
              "faster):", "", "| model | arm | vs | prefill | decode | ranges (pp, tg) |", "|---|---|---|---|---|---|"]
    for model, prep, report in results:
        if not report.ok:
            continue
        by = {s.label: s for s in report.arms}
        pairs = [(a, b) for a in ("A", "W") for b in ("B", "G", "A") if a in by and b in by and a != b]
        for a, b in pairs:
            c = compare(by[a], by[b])
            rows = {r["metric"]: r for r in c.rows}
            lines.append(f"| {model} | {NAMES[a]} | {NAMES[b]} | {rows['pp_tok_s']['ratio']:.2f}x | {rows['tg_tok_s']['ratio']:.2f}x | "
                         f"{'overlap' if rows['pp_tok_s']['overlap'] else 'disjoint'}, "
                         f"{'overlap' if rows['tg_tok_s']['overlap'] else 'disjoint'} |")
    lines += ["", "Memory at steady state (after the timed request), pass with the median RSS; peak during load:", "",
              "| model | arm | peak load | RSS | anon | file | checkpoint mapped in | KV alloc / touched | scratch alloc / touched | unattributed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for model, prep, report in results:
        for s in report.arms if report.ok else ():
            led = s.ledger
            ck = led["checkpoint"]
            name = NAMES[s.label]
            kv_t = mib(led["kv_touched"]) if led["kv_touched"] is not None else "n/a"
            lines.append(f"| {model} | {name} | {mib(s.memory['peak_load'].median)} | {mib(led['total'])} | "
                         f"{mib(led['rss_anon'])} | {mib(led['rss_file'] + led['rss_shmem'])} | "
                         f"{mib(ck['rss_bytes'] - ck['anonymous_bytes'])} of {mib(ck['mapped_bytes'])} | "
                         f"{mib(led['kv_allocated'])} / {kv_t} | {mib(led['scratch_allocated'])} / "
                         f"{mib(led['scratch_touched'])} | {mib(led['unattributed'])} |")
    lines += ["", "Projection (`edgeq inspect`, edgeq.memory) vs measured, w4a16 arm:", "",
              "| model | category | projected | measured | measured - projected |", "|---|---|---|---|---|"]
    for model, prep, report in results:
        a = report.arms[0] if report.ok else None
        for r in (a.projection or {}).get("rows", []) if a else ():
            lines.append(f"| {model} | {r['category']} | {mib(r['projected'])} | {mib(r['measured'])} | {mib(r['diff'])} |")
    lines += ["", "Conversion (`edgeq quantize` in a child process; peak RSS from wait4):", "",
              "| model | scheme: bf16 -> quantised | time | peak RSS | peak RssAnon |", "|---|---|---|---|---|"]
    lines += [_conv_row(model, prep["conversion"]) for model, prep, _ in results]
    lines += [_conv_row(model, prep["conversion_w4a8"], SCHEME_W4A8) for model, prep, _ in results if prep["w4a8"]]
    lines += ["", "Paths counted in the timed request and effective settings (read back):", ""]
    for model, prep, report in results:
        for s in report.arms if report.ok else ():
            e = s.settings
            paths = "; ".join(f"{ph}: " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) for ph, c in s.paths.items())
            if s.kind == "gguf":
                desc = (f"{e.get('model_desc')}, n_ctx {e.get('n_ctx')}, threads {e.get('n_threads')}, repack "
                        f"{'on' if e.get('extra_bufts') else 'off'}")
            else:
                desc = (f"max_model_len {e['max_model_len']}, KV {mib(e['kv_cache_bytes'])}, threads {e['threads_now']}, "
                        f"decode {e['decode_path']}" + (f" ({(e.get('native') or {}).get('isa')})" if e.get("native") else "")
                        + f", prefill {e['prefill_path']}"
                        + (" " + crossover_phrase(e.get("prefill_crossover"))).rstrip()
                        + (f" ({e['path_note']})" if e.get("path_note") else "")
                        + f", loop {e.get('decode_loop')}, decode ops {e.get('decode_ops')}"
                        + (f" (layers {e['decode_layers']})" if e.get("decode_layers", "n/a") != "n/a" else "")
                        + f", prefill attention {e.get('prefill_attn', 'sdpa')}")
            lines.append(f"- {model} {s.label}: {desc}; {paths}")
    for model, prep, report in results:
        for f in report.flags:
            lines.append(f"- FLAG {model}: {f}")
        for n in report.notes:
            lines.append(f"- note {model}: {n}")
    return "\n".join(lines)


CRASHES: list[str] = []  # why llama.cpp's default mode could not run, printed before the tables


def llama_repack_mode(gguf: Path, args, ctx: int) -> str:
    """"on" when llama.cpp runs here with its default repacked weights (one tiny untimed request in a worker), else
    why not ("forced by --llama-no-repack", or the crash); the caller then runs the no-repack mode and says so."""
    if args.llama_no_repack:
        return "forced by --llama-no-repack"
    probe = run_bench([Arm("G", str(gguf), kind="gguf", threads=args.threads, max_model_len=ctx)],
                      BenchConfig(prompt_len=8, gen_len=4, passes=1), progress=lambda m: None, min_passes=1)
    if probe.ok:
        return "on"
    why = str(probe.failures[0].get("error", probe.failures[0]))[:160]
    if "amx_int8" in cpu.flags():  # the known cause on AMX CPUs: ggml's AMX path built by gcc 12
        why += ("; on an AMX CPU with a gcc 12 build of llama.cpp this is gcc's _tile_loadconfig (docs/kernel.md, "
                "\"llama.cpp's AMX path and gcc 12\"; docs/methodology.md has the build that runs)")
    log(f"llama.cpp with repacked weights failed here ({why}); running it without them, labelled in every table")
    CRASHES.append(f"llama.cpp with its repacked weights crashed on {gguf.name} here: {why}. Its arm ran without them: "
                   "a lower bound for llama.cpp, and no edgeq win is claimed from it.")
    return "repacked weights crashed here, see above"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeq-e2e"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--kv-cache-bytes", default="256MiB")
    ap.add_argument("--no-gguf", action="store_true")
    ap.add_argument("--no-w4a8", action="store_true", help="skip the w4a8-g128 arm")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference arm (the slowest: ~4 tok/s decode)")
    # llama.cpp as its users run it: repacked weights (CPU_REPACK / AMX extra buffer types) are its default. Where
    # they crash (llama.cpp 0.3.36's AMX path died with SIGILL on a Sapphire Rapids VM) the arm falls back to
    # no-repack and every table says so; --llama-no-repack forces that mode (a lower bound for llama.cpp).
    ap.add_argument("--llama-no-repack", action="store_true", help="run llama.cpp without its repacked weights")
    ap.add_argument("--json", type=Path, help="also write every report as JSON here")
    ap.add_argument("--refresh-page-cache", action="store_true", help="evict each edgeq checkpoint and read it back "
                    "through a MADV_HUGEPAGE mapping before timing (the page cache after a reboot; docs/runtime.md)")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    why_not = "--no-gguf" if args.no_gguf else gguf_possible()
    if why_not:
        log(f"llama.cpp arm skipped: {why_not}")
    results, machine = [], None
    for model in args.models.split(","):
        schemes = (SCHEME,) if args.no_w4a8 else (SCHEME, SCHEME_W4A8)
        prep = prepare(model, args.workdir, why_not is None, schemes)
        if args.refresh_page_cache:
            for q in (prep["quantized"], prep["w4a8"]):
                if q is not None:
                    refresh_page_cache(Path(q))
        common = dict(threads=args.threads, kv_cache_bytes=args.kv_cache_bytes)
        arms = [Arm("A", str(prep["quantized"]), **common)]
        if prep["w4a8"] is not None:
            arms.append(Arm("W", str(prep["w4a8"]), **common))
        if not args.no_bf16:
            arms.append(Arm("B", str(prep["src"]), **common))
        if prep["gguf"] is not None:
            from edgeq.bench.gguf_arm import default_context  # noqa: PLC0415

            ctx = default_context(str(prep["quantized"]), args.kv_cache_bytes)
            repack = llama_repack_mode(prep["gguf"], args, ctx)
            env = () if repack == "on" else (("EDGEQ_BENCH_LLAMA_REPACK", "0"),)
            NAMES["G"] = "llama.cpp Q4_K_M" + ("" if repack == "on" else f" (repack off: {repack})")
            arms.append(Arm("G", str(prep["gguf"]), kind="gguf", threads=args.threads, max_model_len=ctx, env=env))
        cfg = BenchConfig(prompt_len=args.prompt_len, gen_len=args.gen_len, passes=args.passes)
        report = run_bench(arms, cfg, progress=lambda m, model=model: log(f"{model}: {m}"))
        machine = machine or report.machine
        results.append((model, prep, report))
        if not report.ok:
            log(f"{model}: FAILED: {report.failures}")
    if args.json:
        args.json.write_text(json.dumps([{"model": m, "report": json.loads(to_json(r))} for m, _, r in results], indent=1))
    if why_not:
        print(f"llama.cpp arm: skipped ({why_not}).\n")
    for crash in CRASHES:
        print(f"{crash}\n")
    print(markdown(results, args, machine))


if __name__ == "__main__":
    main()
