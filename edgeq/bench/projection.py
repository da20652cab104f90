"""What ``edgeq inspect`` projects for an arm's memory (:mod:`edgeq.memory`, the one formula), at the context and KV
budget the worker read back, beside what the worker measured: the projection is checked, not trusted."""

from __future__ import annotations

import math

from edgeq.bench.records import Arm
from edgeq.errors import EdgeqError


def projection(arm: Arm, settings: dict, ledger: dict) -> dict:
    """edgeq inspect's memory projection (edgeq.memory, the one formula) at the arm's effective context and budget,
    beside what the worker measured. A bf16 reference is projected as stored (every tensor mapped, no scratch)."""
    try:
        proj, basis = _project(arm.checkpoint, settings)
    except Exception as e:  # noqa: BLE001 - the projection is a comparison, not a reason to fail the benchmark
        return {"rows": [], "basis": f"no projection: {type(e).__name__}: {e}"}
    baseline = sum(r["bytes"] for r in ledger["rows"] if r["category"].startswith("runtime baseline"))
    ckpt = ledger["checkpoint"]
    rows = [
        ("mapped weights (file-backed)", proj.mapped_weights, ckpt["rss_bytes"] - ckpt["anonymous_bytes"],
         f"checkpoint pages mapped (smaps); mincore resident {ckpt['resident_bytes']:,} of {ckpt['mapped_bytes']:,} mapped"),
        ("weight copies (anon)", proj.anon_weights, int(settings.get("copied_bytes") or 0), "runtime copied_bytes"),
        ("KV cache", proj.kv_bytes, ledger["kv_allocated"], f"allocated; touched {ledger['kv_touched']:,}"),
        ("prefill scratch", proj.prefill_scratch, ledger["scratch_allocated"],
         f"allocated; touched {ledger['scratch_touched']:,}"),
        ("total (model part)", proj.total, ledger["total"] - baseline, "steady RSS minus the runtime baseline rows"),
    ]
    return {"basis": basis, "max_model_len": proj.max_model_len, "kv_cache_bytes": proj.kv_cache_bytes,
            "rows": [{"category": c, "projected": int(p), "measured": int(m), "diff": int(m) - int(p), "how": h}
                     for c, p, m, h in rows]}


def _project(path: str, settings: dict):
    """(edgeq.memory.MemoryProjection, how it was made): inspect's for an edgeq checkpoint, the tensors as stored for a
    bf16 reference."""
    budget, mml = int(settings["kv_cache_budget"]), int(settings["max_model_len"])
    if settings.get("quantized"):
        from edgeq.inspect.report import inspect_checkpoint

        rep = inspect_checkpoint(path, max_model_len=mml, kv_cache_bytes=budget)
        if rep.memory is None:
            raise EdgeqError(f"inspect gave no projection: {rep.memory_basis}")
        return rep.memory, "edgeq inspect --max-model-len {} --kv-cache-bytes {}".format(mml, budget)
    from edgeq.io.hf import open_checkpoint
    from edgeq.memory import Tensor, kv_geometry, project

    ckpt = open_checkpoint(path)
    tensors = [Tensor(n, i.dtype, math.prod(i.shape), i.nbytes) for n, i in ckpt.tensors.items()]
    return (project(kv_geometry(ckpt.config), tensors, ("", 0), budget, mml),
            "edgeq.memory.project over the reference's tensors as stored (bf16 mapped, others cast), no scratch")
