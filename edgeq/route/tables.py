"""``edgeq route``'s tables: the device class line, the kernels found, the timings, the schemes and the choice."""

from __future__ import annotations

from edgeq.route.records import RouteReport


def render(r: RouteReport, console) -> None:
    """The report on ``console`` (a rich Console)."""
    from rich.table import Table

    console.print(f"[bold]device class {r.device_class}[/bold] (torch capability {r.torch_capability}, "
                  f"flags {' '.join(r.cpu_flags) or 'none'}) · torch {r.torch_version} · edgeq {r.edgeq_version} · "
                  f"{r.threads} thread(s)", highlight=False)
    t = Table(title="kernels", title_justify="left")
    for col in ("path", "available", "detail"):
        t.add_column(col)
    for k in r.kernels:
        t.add_row(k.name, "yes" if k.available else "[red]no[/red]", k.detail)
    console.print(t)
    t = Table(title=f"measured ({r.source}{', ' + r.cache_file if r.source == 'cached' else ''}): {r.workload}",
              title_justify="left")
    for col in ("path", "N x K", "M", "ms (median)", "min - max"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for x in r.timings:
        t.add_row(x.arm, f"{x.n} x {x.k}", str(x.m), f"{x.ms:.3f}", f"{x.ms_min:.3f} - {x.ms_max:.3f}")
    console.print(t)
    t = Table(title="schemes (the runtime's paths)", title_justify="left")
    for col in ("scheme", "decode path", "ms/token", "prefill path", "prefill ms", "request ms"):
        t.add_column(col, justify="left" if "path" in col or col == "scheme" else "right")
    for s in r.schemes:
        t.add_row(s.scheme, s.decode_path, f"{s.decode_ms:.3f}", s.prefill_path, f"{s.prefill_ms:.1f}",
                  f"{s.cost_ms:.1f}")
    console.print(t)
    console.print(f"[green]fastest here: {r.choice}[/green] — {r.reason}", highlight=False)
