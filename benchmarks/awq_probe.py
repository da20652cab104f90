"""Experiment (issue 16): AWQ-style activation-aware scaling before quantisation, on the bundled model.

For each decoder layer, in order, on calibration activations of the (already scaled, unquantised) float model:
per input channel c, a = mean |x_c|; for alpha in 0, 0.05, ..., 1: s = a^alpha / sqrt(max * min), W' = W diag(s),
the loss is ||X W^T - (X / s) Q(W')^T||^2 summed over the linears that read X (Q = the recipe's rtn at that
linear's group size); the best alpha's s is folded into what produces X: the RMSNorm gamma for q/k/v and gate/up
(gamma / s), up_proj's rows for down_proj (up / s); the linears get W diag(s). The scaled float model is saved as an
HF checkpoint (bf16, like the source) and converted and scored with the real CLI against the *original* model.

    python benchmarks/awq_probe.py out=/tmp/awq [ns=32 seqlen=256 calib=self|text grid=20 skip=down,qkv,mlp]

Prints the chosen alpha per group, the loss ratio (best / alpha 0) and how uneven the input channels are (the largest
mean |x| over the median: AWQ's gain comes from channels far above the rest).
"""
import sys
from pathlib import Path

import torch
import transformers

from edgeq.keys import DATA
from edgeq.quantize.rtn import quantize_groups
from edgeq.layouts import tinygemm as tg

args = dict(a.split("=") for a in sys.argv[1:])
SRC = Path(args.get("src", DATA / "tiny-prose"))
OUT = Path(args.get("out", "/tmp/awq-probe"))
NS, SEQ = int(args.get("ns", 32)), int(args.get("seqlen", 256))
GRID = int(args.get("grid", 20))
SKIP = set(filter(None, args.get("skip", "").split(",")))
G = {"q_proj": 32, "k_proj": 32, "v_proj": 32, "down_proj": 32, "o_proj": 128, "gate_proj": 128, "up_proj": 128}
G.update({k: int(v) for k, v in (kv.split(":") for kv in filter(None, args.get("g", "").split(",")))})


def fq(w: torch.Tensor, g: int) -> torch.Tensor:
    t = quantize_groups(w, g, "rtn")
    return tg.dequantize(t.q, t.scales_and_zeros, g).float()


def calib() -> torch.Tensor:
    if args.get("calib", "self") == "self":
        from edgeq.convert.selfcal import sample_windows
        return sample_windows(SRC, NS, SEQ, seed=int(args.get("seed", 7)))[0]
    from edgeq.convert.calibrate import calibration_windows
    return calibration_windows(SRC, (DATA / "calib-prose.txt").read_text(), NS, SEQ)


def capture(model, ids, module) -> torch.Tensor:
    got = []
    h = module.register_forward_pre_hook(lambda m, a: got.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for i in range(0, ids.shape[0], 8):
            model(ids[i:i + 8])
    h.remove()
    return torch.cat(got)


@torch.no_grad()
def search(x: torch.Tensor, linears: dict) -> tuple[float, torch.Tensor, float]:
    a = x.abs().mean(0).clamp(min=1e-8)
    ref = {n: x @ l.weight.float().T for n, l in linears.items()}
    best, losses = None, []
    for i in range(GRID + 1):
        alpha = i / GRID
        s = a.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        loss = 0.0
        for n, l in linears.items():
            wq = fq(l.weight.float() * s, G[n.split(".")[-1]]) / s
            loss += float((x @ wq.T - ref[n]).square().sum())
        losses.append(loss)
        if best is None or loss < best[0]:
            best = (loss, s, alpha)
    return best[2], best[1], best[0] / losses[0]


def main() -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    ids = calib()
    print(f"calibration {tuple(ids.shape)} ({args.get('calib', 'self')})", flush=True)
    for li, layer in enumerate(model.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        groups = []
        if "qkv" not in SKIP:
            groups.append(("qkv", layer.input_layernorm, at.q_proj,
                           {f"{li}.q_proj": at.q_proj, f"{li}.k_proj": at.k_proj, f"{li}.v_proj": at.v_proj}))
        if "mlp" not in SKIP:
            groups.append(("gate/up", layer.post_attention_layernorm, mlp.gate_proj,
                           {f"{li}.gate_proj": mlp.gate_proj, f"{li}.up_proj": mlp.up_proj}))
        if "down" not in SKIP:
            groups.append(("down", None, mlp.down_proj, {f"{li}.down_proj": mlp.down_proj}))
        for name, norm, first, linears in groups:
            x = capture(model, ids, first).float()
            alpha, s, ratio = search(x, linears)
            with torch.no_grad():
                for l in linears.values():
                    l.weight.mul_(s)
                if norm is not None:
                    norm.weight.div_(s)
                else:
                    mlp.up_proj.weight.div_(s[:, None])
            a = x.abs().mean(0)
            print(f"layer {li} {name}: alpha {alpha:.2f}, loss x{ratio:.3f}; mean |x| per channel max/median "
                  f"{float(a.max() / a.median()):.1f}", flush=True)
    model.to(torch.bfloat16).save_pretrained(OUT)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (SRC / f).exists():
            (OUT / f).write_bytes((SRC / f).read_bytes())
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
