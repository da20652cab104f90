"""The human ``edgeq inspect`` report (rich): a headline, the kind-specific block, tables of bytes and memory, then
warnings in yellow and problems in red. ``--json`` prints the report itself instead (edgeq/inspect/schema.py)."""

from __future__ import annotations

from edgeq.layouts.base import get as get_layout
from edgeq.inspect.kinds import mib
from edgeq.inspect.schema import ForeignInfo, InspectReport


def render(report: InspectReport, console=None, err_console=None) -> None:
    """The compact human report: a headline, the kind-specific block, bytes, memory, then problems in red."""
    from rich.console import Console
    from rich.table import Table

    out = console or Console()
    err = err_console or out
    m, f = report.model, report.files
    params = f"{m['parameters'] / 1e6:,.1f}M parameters" if m["parameters"] >= 1e5 else f"{m['parameters']:,} parameters"
    out.print(f"[bold]{report.path}[/bold]  {report.kind} checkpoint · {m['architecture']} ({m['model_type']}) · "
              f"{params} · {len(f['shards'])} shard(s), {mib(f['bytes'])}, {f['tensors']} tensors", highlight=False)
    if report.edgeq:
        _render_edgeq(report, out)
    if report.foreign:
        _render_foreign(report.foreign, out)
    if report.schemes is not None:
        if not report.bytes_by_category["head"]:
            out.print("  head: tied to the embedding; `edgeq quantize` writes its own quantised head from it (untied)",
                      highlight=False)
        _render_schemes(report, out, Table)
    _render_bytes(report, out, Table)
    if report.memory:
        _render_memory(report, out, Table)
    elif report.memory_basis:
        out.print(f"memory: {report.memory_basis}", highlight=False)
    if report.verify:
        v = report.verify
        out.print(f"verify: {v.tensors_checked} tensors, {mib(v.bytes_read)} read in {v.seconds:.1f} s; shards: "
                  + ", ".join(f"{k} {s}" for k, s in v.shards.items())
                  + (f"; unpack/repack exact on {', '.join(v.roundtrip)}" if v.roundtrip else ""), highlight=False)
    if report.tensors is not None:
        _render_tensors(report, out, Table)
    for w in report.warnings:
        err.print(f"[yellow]warning:[/yellow] {w}", highlight=False, soft_wrap=True)
    for p in report.problems:
        err.print(f"[red]problem: {p}[/red]", highlight=False, soft_wrap=True)
    if not report.problems:
        out.print("[green]no problems found[/green]" + ("" if report.verify else " (headers only; --verify reads the data)"))


def _render_edgeq(report: InspectReport, out) -> None:
    e = report.edgeq
    out.print(f"  {e.scheme} · method {e.method} · kernel {e.kernel} · {report.effective_bits or 0:.2f} bits per "
              f"quantised weight, {report.bits_per_parameter:.2f} bits per parameter overall", highlight=False)
    for g in sorted({g for _, g in e.group_sizes}):  # a recipe's finer groups (docs/format.md)
        names = [m for m, mg in e.group_sizes if mg == g]
        out.print(f"  group size {g} for {len(names)} module(s): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}; "
                  f"the rest {e.group_size}", highlight=False)
    s = e.layout_stored
    color = "green" if e.layout_matches else "yellow"
    what, verdict = get_layout(e.kernel).describe(s, e.layout_matches)
    out.print(f"  layout {str(s.get('layout_hash'))[:12]} ({what}): [{color}]{verdict}[/{color}]; load: {e.on_load}",
              highlight=False)
    head = f"head quantised ({'untied from ' + e.head_source if e.untied else 'from ' + e.head_source})"
    if e.head_levels:  # --head-levels 2: the head sums the packed table's levels too
        head += f", {len(e.head_levels)} levels: " + " + ".join(f"{m} g{g}" for m, g in e.head_levels)
    mnc = ", ".join(f"{k} ({v})" for k, v in e.modules_not_converted.items()) or "none"
    out.print(f"  {head} · {e.quantized_modules} quantised modules · not converted: {mnc}", highlight=False)
    for module, t in e.embeddings.items():
        out.print(f"  embeddings: {embedding_line(module, t)}", highlight=False)


def embedding_line(module: str, t: dict) -> str:
    """E.g. ``model.embed_tokens packed 4-bit = lm_head g32 (the head's) + model.embed_tokens g128, 544.0 KiB
    (bf16: 2.0 MiB)`` or ``model.embed_tokens bf16 (model.embed_tokens.weight), 2.0 MiB``."""
    if t["storage"] != "packed":
        return f"{module} bf16 ({t['source']}), {mib(t['bytes'])}"
    levels = " + ".join(f"{lv['module']} g{lv['group_size']}" + (" (the head's)" if lv["shared"] else "")
                        for lv in t["levels"])
    return f"{module} packed 4-bit = {levels}, {mib(t['bytes'])} (bf16: {mib(t['bf16_bytes'])})"


def _render_foreign(fi: ForeignInfo, out) -> None:
    sym = {True: "symmetric", False: "asymmetric", None: "symmetry ?"}[fi.symmetric]
    method = f" ({fi.quant_method})" if fi.quant_method != fi.format else ""
    out.print(f"  {fi.format}{method} · {fi.bits}-bit · group {fi.group_size} · {sym} · act-order "
              f"{fi.act_order or 'n/a'} · {fi.quantized_modules} quantised modules · shapes give "
              f"{'/'.join(f'{b:g}' for b in fi.bits_seen) or '?'}-bit, groups {list(fi.group_sizes_seen) or '?'}",
              highlight=False)
    details = ", ".join(f"{k}={v}" for k, v in fi.details.items() if v is not None)
    out.print(f"  head: {fi.head}" + (f" · {details}" if details else ""), highlight=False)


def _render_schemes(report: InspectReport, out, Table) -> None:
    t = Table(title="what `edgeq quantize` would write", title_justify="left")
    for col in ("scheme", "size", "ratio", "bits/weight", "cannot quantise"):
        t.add_column(col, justify="left" if col in ("scheme", "cannot quantise") else "right")
    for o in report.schemes:
        cannot = "\n".join(o.cannot_quantize) if o.cannot_quantize else "-"
        t.add_row(o.scheme, mib(o.bytes_out), f"{o.ratio:.2f}x", f"{o.effective_bits:.2f}",
                  f"[red]{cannot}[/red]" if o.cannot_quantize else cannot)
    out.print(t)


def _render_bytes(report: InspectReport, out, Table) -> None:
    t = Table(title="bytes by category", title_justify="left")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    total = sum(report.bytes_by_category.values()) or 1
    for k, v in report.bytes_by_category.items():
        if v:
            t.add_row(k.replace("_", " "), mib(v), f"{100 * v / total:.1f}%")
    out.print(t)


def _render_memory(report: InspectReport, out, Table) -> None:
    mem = report.memory
    t = Table(title=f"memory to serve it at max_model_len {mem.max_model_len:,}, KV budget {mib(mem.kv_cache_bytes)}: "
                    f"{report.memory_basis}", title_justify="left")
    t.add_column("")
    t.add_column("bytes", justify="right")
    t.add_column("", style="dim")
    t.add_row("mapped weights (file-backed)", mib(mem.mapped_weights), "used as stored, shared with the page cache")
    t.add_row("copied weights (anon)", mib(mem.anon_weights),
              "repacked qweights" if mem.repack else "casts of non-bf16 tensors")
    t.add_row("KV cache (anon)", mib(mem.kv_bytes), f"{mem.kv_tokens:,} tokens x {mem.kv_bytes_per_token:,} B")
    t.add_row("prefill scratch (anon)", mib(mem.prefill_scratch), mem.prefill_scratch_tensor)
    t.add_row("[bold]total[/bold]", f"[bold]{mib(mem.total)}[/bold]", f"anonymous {mib(mem.anon_total)}")
    out.print(t)


def _render_tensors(report: InspectReport, out, Table) -> None:
    t = Table(title="tensors", title_justify="left")
    for col in ("name", "shape", "dtype", "role", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for r in report.tensors:
        t.add_row(r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, r.role + (" (q)" if r.quantized else ""),
                  f"{r.bytes:,}")
    out.print(t)
