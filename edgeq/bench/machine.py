"""The machine a benchmark ran on (the report's ``machine`` record) and what its load average says about the run."""

from __future__ import annotations

import os
import platform
import subprocess
import time

from edgeq.cpu import read as read_cpu

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16")


def machine_info() -> dict:
    """CPU model and the ISA flags that matter here, cores, memory, kernel, Python. Memory from psutil (MemTotal of
    /proc/meminfo); the model name and flags from :mod:`edgeq.cpu` (/proc/cpuinfo) and lscpu, which psutil does not
    report (lscpu's model name wins: on Arm /proc/cpuinfo has none)."""
    import psutil

    info = read_cpu()
    model = info.model or platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": model, "flags": [f for f in CPU_FLAGS if f in info.flags], "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "loadavg_start": list(os.getloadavg()),
    }


def load_notes(machine: dict):
    """A note when the load average (at the start or the end of the run) exceeded the cores."""
    cores = machine.get("cores") or 1
    worst = max(machine.get("loadavg_start", [0])[0], machine.get("loadavg_end", [0])[0])
    if worst > cores:
        yield (f"the machine was busy (load average up to {worst:.1f} on {cores} cores): other processes shared the "
               f"CPU, so absolute numbers are low and noisy; ratios of interleaved arms are the robust result")
