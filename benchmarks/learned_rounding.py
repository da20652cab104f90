"""Experiment (issue 16; tried, not kept: docs/gptq.md "Learned rounding"): AutoRound-style learned rounding on top
of GPTQ / RTN codes, fake-quantised, on the bundled model.

    python benchmarks/learned_rounding.py method=rtn steps=200 lr=0.005 vr=0.5 rtn0=1   # from RTN codes (AutoRound's start)
    python benchmarks/learned_rounding.py method=gptq steps=200 lr=0.005 vr=1           # from GPTQ --calib self codes

Other keys: recipe=NAME, scheme=w4a16-gG, bs=8 (windows a step), ns=32 (self-sampled windows, seed 1), sz=0 (learn V
only), head=0 (leave the head at its start codes), decay=0 (a constant step), best=0 (keep the last step).

Per decoder layer: codes q = clamp(round((W - z')/s' + V), -8, 7), w_hat = q s' + z', with V (per weight, init so
that the start codes come out, |V - V0| <= vr), s' = s (1 + a), z' = z + b s per group; signed gradient descent
(step lr, decaying linearly to 0) on the layer's output MSE against the float layer's output (inputs: the
already-quantised stack's), keeping the step with the lowest batch loss; then the head on the logits' KL (a
constant step, the last kept). Evaluation: mean KLD vs the float model on the held-out text, ctx 512, second halves
scored.
"""
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from bench_clipping import windows, score  # noqa
from layer_sensitivity import module_codes  # noqa
from edgeq.convert.pipeline import convert
from edgeq.convert.calibrated import GPTQOptions
from edgeq.convert.selfcal import sample_windows
from edgeq.scheme import Scheme
from edgeq.keys import DATA

torch.manual_seed(0)
SRC = DATA / "tiny-prose"
args = dict(a.split("=") for a in sys.argv[1:])
METHOD = args.get("method", "gptq")
RECIPE = args.get("recipe", None)
SCHEME = args.get("scheme", "w4a16-g128")
STEPS = int(args.get("steps", 300))
LR = float(args.get("lr", 1 / 300))
BS = int(args.get("bs", 8))
NS = int(args.get("ns", 32))
LEARN_SZ = args.get("sz", "1") == "1"
HEAD = args.get("head", "1") == "1"
VR = float(args.get("vr", 1.0))
RTN0 = args.get("rtn0", "0") == "1"
DECAY = args.get("decay", "1") == "1"  # the step decays linearly to 0
BEST = args.get("best", "1") == "1"  # keep the step with the lowest batch loss (else the last)


def codes(out):
    return {m: (q.to(torch.int64) - 8, sz.float(), g) for m, (q, sz, g) in module_codes(out).items()}


def signed_descent(ps, batch_loss, clamp, label, decay, best):
    """STEPS signed steps of LR on ``ps`` (linearly decaying to 0 with ``decay``); with ``best`` the parameters of the
    step with the lowest batch loss are restored at the end, else the last step's stay."""
    kept = [float("inf"), None]
    for step in range(STEPS):
        loss = batch_loss(torch.randint(0, NS, (BS,)))
        for p in ps:
            p.grad = None
        loss.backward()
        if best and loss.item() < kept[0]:
            kept[0], kept[1] = loss.item(), [p.detach().clone() for p in ps]
        with torch.no_grad():
            for p in ps:
                p -= LR * ((1 - step / STEPS) if decay else 1.0) * p.grad.sign()
        clamp()
        if step % 100 == 0 or step == STEPS - 1:
            print(f"  {label} step {step} loss {loss.item():.3e}", flush=True)
    with torch.no_grad():
        for p, b in zip(ps, kept[1] or ()):
            p.copy_(b)


def pick(v, sl):
    if isinstance(v, tuple):
        return tuple(pick(t, sl) for t in v)
    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == NS:
        return v[sl]
    return v


def rnd(x):
    return (x.round() - x).detach() + x


class QW(torch.nn.Module):
    def __init__(self, w, q, sz, g):
        super().__init__()
        self.g, self.w = g, w.float()
        self.s = sz[..., 0].t().contiguous()  # [N, K/G]
        self.z = sz[..., 1].t().contiguous()
        s, z = self.exp(self.s), self.exp(self.z)
        self.v0 = (q.float() - (self.w - z) / s)
        if RTN0:
            self.v0 = torch.zeros_like(self.v0)
        self.v = torch.nn.Parameter(self.v0.clone())
        self.a = torch.nn.Parameter(torch.zeros_like(self.s))
        self.b = torch.nn.Parameter(torch.zeros_like(self.s))

    def exp(self, t):
        return t.repeat_interleave(self.g, dim=1)

    def params(self, final=False):
        s = self.s * (1 + self.a)
        z = self.z + self.b * self.s
        if final:
            s, z = s.bfloat16().float(), z.bfloat16().float()
        return s, z

    def forward(self, final=False):
        s, z = self.params(final)
        S, Z = self.exp(s), self.exp(z)
        t = (self.w - Z) / S + self.v
        q = torch.clamp(rnd(t) if not final else t.round(), -8, 7)
        return q * S + Z

    def clamp_(self):
        with torch.no_grad():
            self.v.copy_(torch.max(torch.min(self.v, self.v0 + VR), self.v0 - VR))
            self.a.clamp_(-0.3, 0.3)
            self.b.clamp_(-1.0, 1.0)


def main():
    gopts = GPTQOptions(calib="self", nsamples=NS) if METHOD == "gptq" else None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q"
        convert(SRC, out, Scheme.parse(SCHEME), METHOD, RECIPE, gptq=gopts, embeddings="bf16")
        C = codes(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(SRC, torch_dtype=torch.float32)
    model.eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(SRC, torch_dtype=torch.float32).eval()
    wins = windows(512, 100)
    with torch.no_grad():
        ref_lp = [torch.log_softmax(ref(w[None]).logits[0, 256:].double(), -1) for w in wins]
    # untie the head
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    mods = dict(model.named_modules())

    def install(final):
        with torch.no_grad():
            for m, qw in QWS.items():
                mods[m].weight.data = qw(final=final).detach().clone()

    QWS = {m: QW(mods[m].weight.detach(), q, sz, g) for m, (q, sz, g) in C.items()}
    install(True)
    base = score(model, ref_lp, wins)
    print(f"init ({METHOD}, {RECIPE or 'family'}) KLD {base[0]:.5f} top1 {base[1]:.4f}", flush=True)

    ids, _ = sample_windows(SRC, nsamples=NS, seqlen=256, seed=1)  # a different seed than GPTQ's calibration
    # capture layer inputs + kwargs on the float model
    cap = {}
    layers = ref.model.layers

    def hook(mod, a, kw):
        cap["h"] = a[0] if a else kw["hidden_states"]
        cap["kw"] = {k: v for k, v in kw.items() if k != "hidden_states"}
        raise StopIteration
    hd = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            ref(ids, use_cache=False)
    except StopIteration:
        pass
    hd.remove()
    kw = cap["kw"]
    kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
    xf = cap["h"].detach()
    xq = xf.clone()
    t0 = time.time()

    def run(layer, x, sl):
        k2 = {k: pick(v, sl) for k, v in kw.items()}
        o = layer(x, **k2)
        return o[0] if isinstance(o, tuple) else o

    for li, layer in enumerate(model.model.layers):
        pre = f"model.layers.{li}."
        names = [m for m in QWS if m.startswith(pre)]
        with torch.no_grad():
            yf = torch.cat([run(ref.model.layers[li], xf[i:i + 8], slice(i, i + 8)) for i in range(0, NS, 8)])
        ps = [p for m in names for p in (QWS[m].v, QWS[m].a, QWS[m].b) if LEARN_SZ or p is QWS[m].v]

        def layer_loss(idx, layer=layer, names=names, pre=pre, yf=yf):
            ws = {m[len(pre):] + ".weight": QWS[m]() for m in names}
            o = torch.func.functional_call(layer, ws, (xq[idx],), {k: pick(v, idx) for k, v in kw.items()})
            o = o[0] if isinstance(o, tuple) else o
            return ((o - yf[idx]) ** 2).mean()

        def clamp_layer(names=names):
            for m in names:
                QWS[m].clamp_()

        signed_descent(ps, layer_loss, clamp_layer, f"layer {li}", DECAY, BEST)
        install(True)
        with torch.no_grad():
            xq = torch.cat([run(layer, xq[i:i + 8], slice(i, i + 8)) for i in range(0, NS, 8)])
            xf = yf
    if HEAD and "lm_head" in QWS:
        qw = QWS["lm_head"]
        with torch.no_grad():
            hf = ref.model.norm(xf)
            hq = model.model.norm(xq)
            lpf = torch.log_softmax(ref.lm_head(hf), -1)
        ps = [qw.v, qw.a, qw.b] if LEARN_SZ else [qw.v]

        def head_kl(idx):
            lq = torch.log_softmax(hq[idx] @ qw().t(), -1)
            return (lpf[idx].exp() * (lpf[idx] - lq)).sum(-1).mean()

        signed_descent(ps, head_kl, qw.clamp_, "head", decay=False, best=False)
    install(True)
    res = score(model, ref_lp, wins)
    print(f"learned: KLD {res[0]:.5f} top1 {res[1]:.4f} (init {base[0]:.5f}) in {time.time() - t0:.0f} s; args {args}", flush=True)


if __name__ == "__main__":
    main()
