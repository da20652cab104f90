"""``edgeq bench``'s output: the rich tables (speed, comparisons, settings and paths, memory ledger, projection vs
measured) and the ``--json`` form (:func:`to_json`: every dataclass as an object, every :class:`Stat` with its
spread)."""

from __future__ import annotations

import json
from dataclasses import asdict

from edgeq.bench.records import ArmSummary, BenchReport, ConvertBench, Stat
from edgeq.runtime.crossover import phrase as crossover_phrase


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fmt(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def fmt_stat(s: Stat | dict, unit: str = "") -> str:
    """``median [min-max]``, e.g. ``11.0 [10.0-12.0]`` (tok/s) or ``0.412 [0.400-0.431]`` (s)."""
    s = Stat(**s) if isinstance(s, dict) else s
    return f"{_fmt(s.median, unit)} [{_fmt(s.min, unit)}-{_fmt(s.max, unit)}]"


def fmt_mem(s: Stat) -> str:
    """A byte :class:`Stat` in MiB, e.g. ``1,024 [1,020-1,030] MiB``."""
    return f"{s.median / 2**20:,.0f} [{s.min / 2**20:,.0f}-{s.max / 2**20:,.0f}] MiB"


def _paths(paths: dict) -> str:
    return "; ".join(f"{phase}: " + (", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none")
                     for phase, c in paths.items())


def render(report: BenchReport, out, err) -> None:
    """The report as tables on ``out`` (a rich Console); failures, flags and notes on ``err``. A failed run prints
    its failures and no number."""
    from rich.table import Table

    m, c = report.machine, report.config
    out.print(f"[bold]edgeq bench[/bold]  {m['cpu']} ({m['cores']} cores; {', '.join(m['flags']) or 'no AVX flags'})  "
              f"{m['date']}  load avg {m['loadavg_start'][0]:.1f} -> {m.get('loadavg_end', [0])[0]:.1f}", highlight=False)
    out.print(f"prompt {c['prompt_len']} tokens, generate {c['gen_len']}, {c['passes']} passes per arm, fresh process "
              f"per pass, interleaved; medians [min-max]", highlight=False)
    if not report.ok:
        for f in report.failures:
            err.print(f"[red]FAILED: arm {f['label']} pass {f['pass_index'] + 1}: {f['error']}[/red]", highlight=False)
            if f.get("stderr_tail"):
                err.print(f["stderr_tail"].strip()[-1500:], highlight=False, markup=False)
        if report.not_run:
            err.print(f"not run: {', '.join(report.not_run)}", highlight=False)
        err.print("[red]no comparison: a pass failed, so no number from this run is reported[/red]")
        return
    t = Table(title="speed (median [min-max])")
    for col in ("arm", "checkpoint", "prefill tok/s", "decode tok/s", "TTFT s", "first-request TTFT s", "load s",
                "CPU share pp/tg"):
        t.add_column(col, justify="left" if col in ("arm", "checkpoint") else "right")
    for s in report.arms:
        share = "/".join(f"{s.timing[k].median:.0%}" for k in ("cpu_share_prefill", "cpu_share_decode") if k in s.timing)
        t.add_row(s.label, _short(s.checkpoint), fmt_stat(s.timing["pp_tok_s"], "tok/s"),
                  fmt_stat(s.timing["tg_tok_s"], "tok/s"), fmt_stat(s.timing["ttft_s"], "s"),
                  fmt_stat(s.timing["ttft_cold_s"], "s"), fmt_stat(s.timing["load_s"], "s"), share or "n/a")
    out.print(t)
    for cmp_ in report.comparisons or ():
        t = Table(title=f"{cmp_.a} vs {cmp_.b}")
        for col in ("metric", cmp_.a, cmp_.b, f"{cmp_.a}/{cmp_.b}", "better", "ranges"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for r in cmp_.rows:
            t.add_row(f"{r['label']} ({r['unit']})", fmt_stat(r["a"], r["unit"]), fmt_stat(r["b"], r["unit"]),
                      f"{r['ratio']:.2f}x", r["better"], "overlap" if r["overlap"] else "disjoint")
        out.print(t)
    t = Table(title="effective settings (read back from each loaded runtime) and counted paths")
    for col in ("arm", "settings", "paths (timed request)"):
        t.add_column(col)
    for s in report.arms:
        t.add_row(s.label, _settings_line(s), _paths(s.paths))
    out.print(t)
    for s in report.arms:
        _render_memory(s, out)
    for f in report.flags:
        err.print(f"[red]FLAG: {f}[/red]", highlight=False)
    for n in report.notes:
        err.print(f"[yellow]note: {n}[/yellow]", highlight=False)


def _short(p: str, n: int = 40) -> str:
    return p if len(p) <= n else "..." + p[-(n - 3):]


def _settings_line(s: ArmSummary) -> str:
    e = s.settings
    if s.kind == "gguf":
        return (f"llama.cpp {e.get('model_desc')}; n_ctx {e.get('n_ctx')}, KV {_mib(e.get('kv_cache_bytes', 0))} "
                f"(computed), threads {e.get('n_threads')}/{e.get('n_threads_batch')}, batch {e.get('n_batch')}/"
                f"{e.get('n_ubatch')}; {e.get('system_info', '')[:80]}")
    native = e.get("native") or {}
    xover = crossover_phrase(e.get("prefill_crossover"))
    return (f"{e.get('scheme') or 'bf16'}; max_model_len {e.get('max_model_len')}, KV {_mib(e.get('kv_cache_bytes', 0))} "
            f"of {_mib(e.get('kv_cache_budget', 0))} budget, threads {e.get('threads_now')}, decode {e.get('decode_path')}"
            f"{' (' + str(native.get('isa')) + ')' if native else ''}, prefill {e.get('prefill_path')}"
            f"{' ' + xover if xover else ''} ({e.get('crossover_source')}), layout {e.get('layout')}")


def _render_memory(s: ArmSummary, out) -> None:
    from rich.table import Table

    mem, led = s.memory, s.ledger
    cached = mem["checkpoint_cached_before_load"]
    out.print(f"[bold]memory, arm {s.label}[/bold]: peak during load {fmt_mem(mem['peak_load'])}, peak while running "
              f"{fmt_mem(mem['peak_run'])}, whole-life peak {fmt_mem(mem['maxrss_self'])} (largest helper child "
              f"{fmt_mem(mem['maxrss_children'])}, e.g. a kernel build); steady RSS "
              f"{fmt_mem(mem['steady_rss'])} = anon {fmt_mem(mem['steady_anon'])} + file {fmt_mem(mem['steady_file'])}; "
              f"checkpoint in page cache before load: {min(cached) / max(mem['checkpoint_file_bytes'], 1):.0%}-"
              f"{max(cached) / max(mem['checkpoint_file_bytes'], 1):.0%}", highlight=False)
    t = Table(title=f"ledger, arm {s.label} (steady state, pass with the median RSS)")
    for col in ("kind", "category", "bytes", "measured by"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for r in led["rows"]:
        t.add_row(r["kind"], r["category"], _mib(r["bytes"]), r["how"])
    t.add_row("", "[bold]total (VmRSS)[/bold]", _mib(led["total"]),
              f"explained {led['explained'] / max(led['total'], 1):.1%}, unattributed {_mib(led['unattributed'])}")
    out.print(t)
    ck = led["checkpoint"]
    out.print(f"checkpoint {s.label}: mapped {_mib(ck['mapped_bytes'])}; resident in RAM (mincore) "
              f"{_mib(ck['resident_bytes'])}; faulted into this process (smaps Rss) {_mib(ck['rss_bytes'])}; "
              f"copy-on-write {_mib(ck['anonymous_bytes'])}; huge-page mapped (smaps FilePmdMapped) "
              f"{_mib(ck.get('pmd_mapped_bytes', 0))}. KV cache allocated {_mib(led['kv_allocated'])}, touched "
              + (_mib(led['kv_touched']) if led['kv_touched'] is not None else "n/a")
              + f"; prefill scratch allocated {_mib(led['scratch_allocated'])}, touched {_mib(led['scratch_touched'])}",
              highlight=False)
    p = s.projection
    if p and p.get("rows"):
        t = Table(title=f"projection vs measured, arm {s.label} ({p['basis']})")
        for col in ("category", "projected", "measured", "measured - projected", "measured as"):
            t.add_column(col, justify="left" if col in ("category", "measured as") else "right")
        for r in p["rows"]:
            t.add_row(r["category"], _mib(r["projected"]), _mib(r["measured"]), _mib(r["diff"]), r["how"])
        out.print(t)
    elif p:
        out.print(p["basis"], highlight=False)


def render_convert(r: ConvertBench, out, err) -> None:
    """``edgeq bench --convert``'s summary line (or its failure)."""
    m = r.machine
    out.print(f"[bold]edgeq bench --convert[/bold] {r.model} ({r.scheme or 'recipe default'}), {m['cpu']}, "
              f"{m['cores']} cores, {m['date']}, load avg {m['loadavg_start'][0]:.1f}", highlight=False)
    for f in r.failures:
        err.print(f"[red]FAILED: conversion pass {f['pass_index'] + 1}: {f['error']}[/red]", highlight=False)
    if r.failures:
        return
    out.print(f"  {_mib(r.bytes_in)} -> {_mib(r.bytes_out)}; time {fmt_stat(r.seconds, 's')} s; peak RSS of the child "
              f"(wait4) {fmt_mem(r.peak_rss)}; peak RssAnon {fmt_mem(r.peak_anon)}; {r.passes} pass(es)", highlight=False)


def to_json(value) -> str:
    """``--json``: dataclasses as objects (fields in order), tuples as lists, each :class:`Stat` with its ``spread``."""
    def default(o):
        if isinstance(o, Stat):
            return {**asdict(o), "spread": o.spread}
        return str(o)

    def conv(o):
        if isinstance(o, Stat):
            return {**asdict(o), "spread": o.spread}
        if hasattr(o, "__dataclass_fields__"):
            return {k: conv(getattr(o, k)) for k in o.__dataclass_fields__}
        if isinstance(o, dict):
            return {k: conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [conv(v) for v in o]
        return o

    return json.dumps(conv(value), indent=2, default=default)
