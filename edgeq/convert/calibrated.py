"""``edgeq quantize --method gptq``: the plan, the calibration windows, and writing what the layer-streamed driver
(:func:`edgeq.convert.calibrate.gptq_model`) yields.

The driver calibrates one decoder layer at a time and yields results in execution order. The writer needs a
declared order, so the quantised tensors are declared in the predicted execution order (layer by layer,
q/k/v/o/gate/up/down, then the head: :func:`write_order`) after every copied tensor; a result that arrives before
its turn is held (packed, N*K/2 bytes) until it is due (:class:`InOrder`). Peak memory: the driver's (one layer,
the calibration activations) plus whatever is held, normally nothing. GPTQ writes the tinygemm layout only (the
W4A8 packer refuses the method before anything is read).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edgeq import cpu, env
from edgeq.convert import selfcal, w4a16
from edgeq.convert.calibrate import SUPPORTED_MODEL_TYPES, TARGETS, calibration_windows, gptq_model
from edgeq.convert.embeddings import write_levels
from edgeq.convert.plan import Plan, PlanEntry, build_plan, group_sizes, packed_bytes
from edgeq.convert.recipe import Recipe
from edgeq.convert.stream import Progress, copy_entry, rss
from edgeq.console import say
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.safetensors import ShardedWriter
from edgeq.keys import DATA, Action, Role
from edgeq.quantize.gptq import GROUP_PARAMS
from edgeq.layouts.tinygemm import TinygemmLayout, check_values
from edgeq.scheme import Scheme

METHOD = "gptq"
DEFAULT_CALIB = DATA / "calib-prose.txt"  # disjoint from heldout-prose.txt (fidelity's text)
TEXT_NSAMPLES, TEXT_SEQLEN = 128, 512  # a text's windows, when not given
_IN_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # the driver's execution order in the supported families
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class GPTQOptions:
    """``--method gptq`` settings: calibration text (or ``"self"``: tokens sampled from the model, seeded), windows,
    act-order, dampening, how each group's (scale, zero) are chosen (docs/gptq.md). ``nsamples`` / ``seqlen`` left
    as None take the source's defaults: 128 x 512 for a text; for ``self`` seqlen 256 and nsamples None, resolved
    from the model when sampling (:func:`edgeq.convert.selfcal.default_nsamples`: 32, more for a widest Linear input
    above 2048)."""

    calib: str = str(DEFAULT_CALIB)
    nsamples: int | None = None
    seqlen: int | None = None
    act_order: bool = False
    damp: float = 0.01
    block_size: int = 128
    seed: int = selfcal.SEED  # --calib self only: the sampling seed
    group_params: str = GROUP_PARAMS[0]  # each group's (scale, zero): the rtn search, or GPTQ's original min/max
    target: str = TARGETS[0]  # fit each Linear to the float model's outputs, or to its own float weights (docs/gptq.md)

    def __post_init__(self) -> None:
        object.__setattr__(self, "calib", str(self.calib))  # a Path from the CLI
        own = (None, selfcal.SEQLEN) if self.calib == selfcal.SELF else (TEXT_NSAMPLES, TEXT_SEQLEN)
        object.__setattr__(self, "nsamples", own[0] if self.nsamples is None else self.nsamples)
        object.__setattr__(self, "seqlen", own[1] if self.seqlen is None else self.seqlen)

    @property
    def calib_file(self) -> Path | None:
        """The calibration text this conversion reads; None for ``self``."""
        return None if self.calib == selfcal.SELF else Path(self.calib)

    def check(self) -> None:
        compute_dtype()  # a bad $EDGEQ_CALIB_DTYPE fails before anything is read or written
        if (self.nsamples is not None and self.nsamples < 1) or self.seqlen < 2:
            raise EdgeqError(f"--nsamples {self.nsamples} / --seqlen {self.seqlen}: need at least 1 window of at least 2 tokens")
        if self.group_params not in GROUP_PARAMS:
            raise EdgeqError(f"--gptq-params {self.group_params}: must be one of {', '.join(GROUP_PARAMS)}")
        if self.target not in TARGETS:
            raise EdgeqError(f"--gptq-target {self.target}: must be one of {', '.join(TARGETS)}")
        if not 0.0 < self.damp <= 1.0:
            raise EdgeqError(f"--damp {self.damp}: must be in (0, 1] (a fraction of the mean Hessian diagonal; default 0.01)")
        if self.calib_file is None:
            if Path(selfcal.SELF).is_file():
                raise EdgeqError(f"--calib self samples from the model, but ./self is a file here; to calibrate on that "
                                 f"file give its full path ({Path(selfcal.SELF).resolve()})")
        elif not self.calib_file.is_file():
            raise EdgeqError(f"--calib {self.calib}: no such file; give a UTF-8 text file, or 'self' (sampled from the model)")


def gptq_plan(ckpt: Checkpoint, scheme: Scheme, recipe: Recipe, opts: GPTQOptions) -> Plan:
    """The float plan with method gptq; with act-order every quantised output also carries M.perm."""
    opts.check()
    model_type = ckpt.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EdgeqError(f"{ckpt.root / 'config.json'}: model_type {model_type!r} is not supported by GPTQ calibration "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --method rtn")
    return calibrated_plan(build_plan(ckpt, scheme, METHOD, recipe), scheme, opts)


def calibrated_plan(plan: Plan, scheme: Scheme, opts: GPTQOptions) -> Plan:
    """``plan`` carrying the GPTQ options; with act-order every quantised output also carries M.perm (its bytes)."""
    if opts.act_order:
        entries = tuple(
            replace(e, perm=True, bytes_out=packed_bytes(e.shape, scheme, e.group(scheme), perm=True))
            if e.quantized and e.bytes_out else e
            for e in plan.entries
        )
        plan = replace(plan, entries=entries)
    return replace(plan, options=opts)


def sampling_progress(every: float = 60.0, clock=time.perf_counter) -> selfcal.Progress:
    """A :func:`selfcal.sample_windows` progress callback: at most once every ``every`` seconds, one line of how many
    tokens are sampled and about how long the rest takes (every step costs about the same: the elapsed time scaled by
    the tokens left). Nothing for a run shorter than ``every`` (the bundled model samples in seconds).
    E.g. 8,192 of 32,768 tokens after 120 s: ``--calib self: 8,192 / 32,768 tokens (25%) in 120 s, about 6 min left``."""
    start = last = clock()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = clock()
        if 0 < done < total and now - last >= every:
            last, left = now, (now - start) * (total - done) / done
            rest = f"{left:.0f} s" if left < 90 else f"{left / 60:.0f} min"
            say(f"--calib self: {done:,} / {total:,} tokens ({done / total:.0%}) in {now - start:.0f} s, about {rest} left")

    return report


def calibration(ckpt: Checkpoint, plan: Plan) -> tuple[torch.Tensor, dict]:
    """Token windows from the --calib text (the model's tokenizer), or sampled from the model (``self``), and
    their record for the manifest."""
    opts: GPTQOptions = plan.options
    if opts.calib_file is None:
        k_max = max(e.shape[1] for e in plan.entries if e.quantized)
        n = opts.nsamples or selfcal.default_nsamples(k_max, opts.seqlen)
        say(f"--calib self: sampling {n} x {opts.seqlen} calibration tokens from the model (seed {opts.seed})")
        t0 = time.perf_counter()
        windows, record = selfcal.sample_windows(ckpt.root, n, opts.seqlen, opts.seed, progress=sampling_progress(),
                                                 dtype=sampling_dtype())
        say(f"--calib self: sampled in {time.perf_counter() - t0:.0f}s")
        return windows, {**record, "nsamples_asked": opts.nsamples, "widest_input": k_max}
    path = opts.calib_file
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise EdgeqError(f"--calib {path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise EdgeqError(f"--calib {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    windows = calibration_windows(ckpt.root, text, opts.nsamples, opts.seqlen)
    record = {"file": path.name, "sha256": hashlib.sha256(raw).hexdigest(), "windows": int(windows.shape[0]),
              "seqlen": int(windows.shape[1]), "tokens": int(windows.numel()), "nsamples_asked": opts.nsamples}
    return windows, record


def write_order(plan: Plan) -> list[PlanEntry]:
    """The order tensors are declared (and written) in: the plan's, except for ``gptq``, which writes every copied
    tensor first and then the quantised ones in the driver's predicted execution order, head last, then a packed
    embedding (its residual reads the head back)."""
    if plan.method != METHOD:
        return list(plan.entries)
    packed = [e for e in plan.entries if e.action == Action.PACK_EMBEDDING]
    rest = [e for e in plan.entries if not e.quantized and e.action != Action.PACK_EMBEDDING]
    return rest + sorted((e for e in plan.entries if e.quantized), key=_execution_key) + packed


def _execution_key(e: PlanEntry) -> tuple:
    if e.role == Role.HEAD:
        return (2, 0, 0, "")
    m = _LAYER.search(e.module)
    if m is None:
        return (0, 0, 0, e.module)  # outside the decoder layers: the driver never yields it, which is an error later
    tail = e.module[m.end():]
    return (1, int(m.group(1)), _IN_LAYER.index(tail) if tail in _IN_LAYER else len(_IN_LAYER), tail)


class InOrder:
    """Writes each module's tensors in the writer's declared order; a module that arrives early is held until due.

    ``held_peak`` is the most bytes ever held (0 when the driver's order is the predicted one)."""

    def __init__(self, writer: ShardedWriter, modules: list[str]):
        self.writer, self.modules, self.i = writer, modules, 0
        self.pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.held = self.held_peak = 0

    def put(self, module: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.pending[module] = tensors
        self.held += sum(t.numel() * t.element_size() for _, t in tensors)
        while self.i < len(self.modules) and self.modules[self.i] in self.pending:
            for name, t in self.pending.pop(self.modules[self.i]):
                self.writer.write(name, t)
                self.held -= t.numel() * t.element_size()
            self.i += 1
        self.held_peak = max(self.held_peak, self.held)

    def missing(self) -> list[str]:
        return self.modules[self.i:]


def pack_result(e: PlanEntry, r, record: TinygemmLayout) -> list[tuple[str, torch.Tensor]]:
    """A GPTQResult as the tensors this entry declared: packed qweight (row blocks), scales_and_zeros, perm."""
    n, k = e.shape
    if tuple(r.q.shape) != (n, k):
        raise EdgeqError(f"{e.module}: GPTQ produced q {list(r.q.shape)}, the plan expects [{n}, {k}]")
    if (r.perm is not None) != e.perm:
        raise EdgeqError(f"{e.module}: GPTQ {'returned' if r.perm is not None else 'did not return'} an input permutation, "
                         f"the plan {'expects' if e.perm else 'does not expect'} one")
    check_values(r.q, e.module)
    out = [(f"{e.module}.qweight", w4a16.pack_rows(r.q, record)), (f"{e.module}.scales_and_zeros", r.scales_and_zeros.contiguous())]
    if e.perm:
        out.append((f"{e.module}.perm", r.perm.to(torch.int64).contiguous()))
    return out


class _Layers:
    """The driver's layer progress, turned into ``layer i/n, ETA ...`` labels."""

    def __init__(self, progress: Progress):
        self.progress, self.t0, self.done, self.total = progress, time.perf_counter(), 0, 1

    def __call__(self, done: int, total: int, label: str) -> None:
        self.done, self.total = done, total
        self.progress(0, self.label(label))

    def label(self, what: str) -> str:
        elapsed = time.perf_counter() - self.t0
        eta = f", ETA {elapsed / self.done * (self.total - self.done):.0f}s" if self.done else ""
        return f"layer {min(self.done + 1, self.total)}/{self.total}{eta}: {what}"


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _calib_dtype() -> str:
    """``$EDGEQ_CALIB_DTYPE``: auto | bf16 | fp32 (an :class:`EdgeqError` naming the variable otherwise)."""
    return env.choice(None, "calib_dtype", env.CALIB_DTYPE, ("auto", *_DTYPES))[0]


def compute_dtype() -> torch.dtype:
    """The GPTQ sweep's compute dtype (activations, forward passes; Hessians and the solve are fp32 either way):
    ``$EDGEQ_CALIB_DTYPE`` bf16 | fp32, or auto: bf16 where the CPU has bf16 dot products (AVX512-BF16, AMX), else
    fp32, where bf16 GEMMs are emulated and slower (docs/gptq.md, "Compute dtype")."""
    picked = _calib_dtype()
    if picked == "auto":
        picked = "bf16" if cpu.has_bf16_dot() else "fp32"
    return _DTYPES[picked]


def sampling_dtype() -> torch.dtype | None:
    """``--calib self``'s compute dtype: None (auto: the stored dtype, the weights mapped, no copy) unless
    ``$EDGEQ_CALIB_DTYPE`` names one; then weights stored in another dtype are cast, a copy of the model (fp32 on a
    CPU without bf16 dot products: faster sampling for twice the memory; docs/gptq.md, "Compute dtype")."""
    return _DTYPES.get(_calib_dtype())  # auto: None


def stream_gptq(ckpt: Checkpoint, plan: Plan, order: list[PlanEntry], record: TinygemmLayout, writer: ShardedWriter,
                progress: Progress, windows: torch.Tensor) -> dict:
    """Copies first, then every quantised module as the layer-streamed GPTQ driver yields it (the plan's head
    module is the driver's last result), then a packed embedding against the head as written. Returns what
    :func:`edgeq.convert.stream.stream` returns."""
    opts: GPTQOptions = plan.options
    for e in order:
        if e.quantized:
            break
        copy_entry(ckpt, e, writer, progress)
    quantized = [e for e in order if e.quantized]
    by_module = {e.module: e for e in quantized}
    sink = InOrder(writer, [e.module for e in quantized])
    layers = _Layers(progress)
    keep = frozenset(e.module for e in plan.entries if e.action == Action.KEEP)
    dtype = compute_dtype()
    results = gptq_model(ckpt.root, windows, plan.scheme, damp=opts.damp, act_order=opts.act_order,
                         block_size=opts.block_size, group_params=opts.group_params, keep=keep, head_source=plan.head.source,
                         head_module=plan.head_module, group_sizes=group_sizes(plan), compute_dtype=dtype,
                         target=opts.target, progress=layers)
    errors, rel_out, damp_used, anon_peak = {}, {}, {}, 0
    try:
        for name, r in results:
            e = by_module.get(name)
            if e is None or name in errors:
                raise EdgeqError(f"{name}: GPTQ calibration produced a module the plan does not quantise (or twice); "
                                 "use --method rtn for this model")
            sink.put(name, pack_result(e, r, record))
            errors[name], rel_out[name] = r.relative_error, r.relative_output_error
            if r.damp != opts.damp:
                damp_used[name] = r.damp
            progress(e.bytes_in, layers.label(name))
            anon_peak = max(anon_peak, rss()[0])
    finally:
        results.close()
    if sink.missing():
        miss = sink.missing()
        raise EdgeqError(f"GPTQ calibration did not produce {len(miss)} planned module(s), e.g. {miss[:3]}; "
                         "they are not Linears of the decoder layers; use --method rtn for this model")
    embeddings = {}
    if (e := plan.packed_embedding) is not None:
        embeddings = write_levels(ckpt, plan, e, record, writer, progress)
        anon_peak = max(anon_peak, rss()[0])
    details = {"act_order": opts.act_order, "damp": opts.damp, "block_size": opts.block_size,
               "compute_dtype": str(dtype).removeprefix("torch."),
               "group_params": opts.group_params, "target": opts.target,
               "damp_escalated": damp_used, "relative_output_error": rel_out, "held_peak_bytes": sink.held_peak}
    return {"errors": errors, "anon_peak": anon_peak, "details": details, "embeddings": embeddings}
