"""The modelled request and the choice rule: per scheme, the paths the runtime itself would take and what the
request costs on them; the cheapest scheme wins. Pure: the timings are given."""

from __future__ import annotations

from edgeq.route.records import SchemeCost, Timing

SHAPES = ((1536, 1536), (8960, 1536))  # (N, K)
GROUP_SIZE = 128
PREFILL_M = 512
DECODE_TOKENS = 128  # the modelled request: one 512-token prefill, then 128 decode steps


def choose(timings: list[Timing], found_arms: set[str], group_size: int = GROUP_SIZE,
           prefill_m: int = PREFILL_M, decode_tokens: int = DECODE_TOKENS) -> tuple[list[SchemeCost], str, str]:
    """Per scheme, the runtime's paths and their modelled cost; returns (costs, chosen scheme, reason).

    W4A16: decode on ``native`` if measured, else ``tinygemm``; prefill on the faster of that kernel and
    ``dequant_prefill`` (summed over shapes). W4A8: ``w4a8_kernel`` if measured, else ``w4a8_portable``, all M.
    """
    def total(arm: str, m: int) -> float:
        return sum(t.ms for t in timings if t.arm == arm and t.m == m)

    costs = []
    if "tinygemm" in found_arms:
        dec = "native" if "native" in found_arms else "tinygemm"
        pre = min((dec, "dequant_prefill"), key=lambda a: total(a, prefill_m) if a in found_arms else float("inf"))
        d, p = total(dec, 1), total(pre, prefill_m)
        costs.append(SchemeCost(f"w4a16-g{group_size}", dec, pre, d, p, p + decode_tokens * d))
    w8 = "w4a8_kernel" if "w4a8_kernel" in found_arms else "w4a8_portable"
    d, p = total(w8, 1), total(w8, prefill_m)
    costs.append(SchemeCost(f"w4a8-g{group_size}", w8, w8, d, p, p + decode_tokens * d))
    best = min(costs, key=lambda c: c.cost_ms)
    others = ", ".join(f"{c.scheme} {c.cost_ms:.1f} ms" for c in costs if c is not best)
    reason = (f"{best.scheme} is cheapest for the modelled request: {best.cost_ms:.1f} ms "
              f"(decode {best.decode_path} {best.decode_ms:.2f} ms/token, prefill {best.prefill_path} "
              f"{best.prefill_ms:.1f} ms)" + (f" vs {others}" if others else ""))
    return costs, best.scheme, reason
