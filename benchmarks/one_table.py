"""Experiment (issue 16; tried, not kept: docs/gptq.md "One 4-bit table for both ends"): a tied model's head and
embedding as ONE 4-bit table (llama.cpp's choice for tied models; edgeq stores a residual level for the lookup).

    python benchmarks/one_table.py            # GPTQ on the bundled calibration text
    python benchmarks/one_table.py self       # GPTQ on self-sampled windows

Bundled model, fake-quantised (the checkpoints' dequantised weights in the fp32 transformers model, head untied),
every Linear and the head at g32 (2,621,440 bytes for linears + head + table: under Q4_K_M's 2,747,904), the head by
GPTQ at dampings 0.01 / 0.1 / 1.0 (more damping: closer to rtn, a better table) or by rtn; the embedding is the bf16
table (the reference), the head's own dequantisation (one table), or a separate rtn g32 table. Mean KLD vs the
float model on the held-out text, ctx 512, second halves scored (bench_clipping's windows).
"""
import sys, tempfile
from pathlib import Path
import torch, transformers
sys.path.insert(0, str(Path(__file__).parent))
from bench_clipping import dequantized_state, windows, score
from edgeq.convert.pipeline import convert
from edgeq.convert.calibrated import GPTQOptions
from edgeq.scheme import Scheme
from edgeq.keys import DATA
SRC = DATA / "tiny-prose"
calib = sys.argv[1] if len(sys.argv) > 1 else None
tmp = Path(tempfile.mkdtemp())
(tmp / "u.toml").write_text('name = "u"\nmodel_types = []\nscheme = "w4a16-g32"\nmethod = "rtn"\nhead = "lm_head.weight"\n'
                            'embeddings = ["model.embed_tokens.weight"]\nkeep_bf16 = []\n')
states = {}
for label, method, damp in (("gptq.01", "gptq", 0.01), ("gptq.1", "gptq", 0.1), ("gptq1", "gptq", 1.0), ("rtn", "rtn", None)):
    g = GPTQOptions(**({"calib": calib} if calib else {}), damp=damp) if method == "gptq" else None
    convert(SRC, tmp / label, Scheme.parse("w4a16-g32"), method, str(tmp / "u.toml"), gptq=g, embeddings="bf16")
    states[label] = dequantized_state(tmp / label)
    print("converted", label, flush=True)
ref = transformers.AutoModelForCausalLM.from_pretrained(SRC, torch_dtype=torch.float32).eval()
wins = windows(512, 100)
with torch.no_grad():
    ref_lp = [torch.log_softmax(ref(w[None]).logits[0, 256:].double(), -1) for w in wins]
emb0 = ref.model.embed_tokens.weight.detach().clone()
def arm(lin, head, table):
    m = transformers.AutoModelForCausalLM.from_pretrained(SRC, torch_dtype=torch.float32).eval()
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    mods = dict(m.named_modules())
    with torch.no_grad():
        for k, w in states[lin].items():
            if k != "lm_head.weight":
                mods[k[:-7]].weight.data = w.float().clone()
        m.lm_head.weight.data = states[head]["lm_head.weight"].float().clone()
        m.model.embed_tokens.weight.data = (emb0.clone() if table == "bf16" else states[table]["lm_head.weight"].float().clone())
    return score(m, ref_lp, wins)
for lin, head, table in (("gptq.01", "gptq.01", "bf16"), ("gptq.01", "gptq.01", "gptq.01"), ("gptq.01", "gptq.1", "gptq.1"),
                         ("gptq.01", "gptq1", "gptq1"), ("gptq.01", "rtn", "rtn"), ("gptq.01", "rtn", "bf16"),
                         ("gptq.01", "gptq.01", "rtn")):
    k, t = arm(lin, head, table)
    print(f"linears {lin:8s} head {head:8s} table {table:8s}  KLD {k:.5f}  top1 {t:.4f}", flush=True)
