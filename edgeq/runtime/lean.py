"""The lean decode loop: one token through the model with edgeq's own code, no transformers forward per token.

It runs the dense families whose decoder layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` with RMSNorm,
rotary embeddings and a SiLU-gated MLP: Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm over each
head). Phi-3 (fused projections, longrope) and Gemma-2 (softcapping, scaled embeddings, (1 + w) norms) keep the
transformers forward; :func:`support` says why, and ``settings.decode_loop`` reports which loop runs.

Nothing is copied: the decoder holds references to the loaded modules and tensors (every projection and the head
are the model's :class:`~edgeq.runtime.qlinear.Int4Linear`, or ``nn.Linear`` for a bf16 reference checkpoint; the
norm weights and a bf16 embedding are the mapped views, a packed embedding decodes the token's row from its mapped
4-bit levels: :func:`edgeq.runtime.embedding.row_reader`) and writes keys and values into the same
:class:`~edgeq.runtime.kvcache.StaticKVCache` the transformers forward uses, so a prompt prefilled by transformers
continues here. What it owns, allocated once at construction: RoPE tables for ``max_model_len`` positions and
the activation buffers of one token that its decode ops use (the other ops' only if it is switched to them). A step
writes into those with ``out=`` variants and in-place ops; the only tensors a step allocates are the outputs of ops
that have no ``out=`` form (the int4 kernel's result of each projection and of the head, and SDPA's result when SDPA
runs: docs/runtime.md counts them).

Decode ops (:func:`ops_choice`, ``settings.decode_ops``): by default edgeq's native ops around the projections
(``edgeq.runtime.native``: ``decode_attn``, fp32 softmax over the cache read in place with one rounding, several
times faster than torch's flash-attention CPU kernel for one query; ``add_rms_norm``; ``rope_to_cache``), close to
the eager ops, not bit-equal (tests/test_lean.py bounds the logits), and where the modules allow all the layers' ops
in one native call (:mod:`edgeq.runtime.stack`, ``decode_layers``: the same bits); ``decode_ops="torch"`` keeps the
eager ops and SDPA. With those every op repeats the transformers computation in the same order and dtype, so the
logits are bit-identical to the transformers forward on the same cache (tests/test_lean.py), except on
sliding-window layers past the window (SDPA over the window's slice instead of a masked full row: equal within bf16
rounding). Per layer, with x the bf16 residual [1, H]::

    n   = w_in * bf16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps))        # RMSNorm, two roundings as transformers
    q, k, v = n @ Wq^T (+ bq), n @ Wk^T (+ bk), n @ Wv^T (+ bv)      # [heads*d], [kv_heads*d] each
    q, k = norm_q(q), norm_k(k) per head                                # Qwen3 only
    r(t) = t * cos[p] + rotate_half(t) * sin[p]                        # rotate_half(t) = cat(-t[d/2:], t[:d/2])
    K[p], V[p] = r(k), v;  a = SDPA(r(q), K[:p+1], V[:p+1])            # GQA: kv head j serves heads j*g..j*g+g-1
    x += a @ Wo^T;  n = w_post * norm(x);  x += (silu(n @ Wg^T) * (n @ Wu^T)) @ Wd^T

``rotate_half(t) * sin`` is computed as ``swap_halves(t) * nsin`` with ``nsin = cat(-sin[:d/2], sin[d/2:])``:
``(-a) * b == a * (-b)`` exactly in floating point, so this is the same number with one op fewer. Worked example,
d = 4, t = [a, b, c, e], sin = [s0, s1, s0, s1]: rotate_half(t) * sin = [-c*s0, -e*s1, a*s0, b*s1] and
swap_halves(t) * nsin = [c, e, a, b] * [-s0, -s1, s0, s1], the same four products.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgeq.env import DECODE_OPS as ENV_DECODE_OPS, choice
from edgeq.errors import EdgeqError
from edgeq.runtime import embedding, native, projections, stack
from edgeq.runtime.rmsnorm import RMSNorm as _RMSNorm, eps_tensor as _eps
from edgeq.runtime.rope import STATIC_ROPE, rope_tables

DECODE_OPS = ("auto", "native", "torch")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def support(model: nn.Module, config) -> str | None:
    """None when the lean loop runs ``model``; otherwise why not (a sentence, reported in the settings)."""
    family = getattr(config, "model_type", "?")
    if family not in FAMILIES:
        return f"{family}: not one of the lean loop's families ({', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{family}: hidden_act {config.hidden_act!r} (the lean loop implements silu)"
    body = getattr(model, "model", None)
    rotary = getattr(body, "rotary_emb", None)
    rope = getattr(rotary, "rope_type", None)
    if rope not in STATIC_ROPE:
        return f"{family}: rope_type {rope!r} (the lean loop implements {', '.join(STATIC_ROPE)})"
    if embedding.row_reader(getattr(body, "embed_tokens", None)) is None:
        return f"{family}: no embed_tokens embedding (an unscaled bf16 table or edgeq's packed one)"
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(_is_linear(m) for m in mods):
            return f"model.layers.{i}: a projection is neither an edgeq quantised Linear nor a Linear"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if family == "qwen3":
            norms += [attn.q_norm, attn.k_norm]
        if any(type(n).__name__ not in _NORM_CLASSES for n in norms):
            return f"model.layers.{i}: a norm is not a plain RMSNorm"
        if family == "qwen3" and attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return f"model.layers.{i}: q_norm and k_norm have different eps (the lean loop normalises q and k together)"
    if not _is_linear(getattr(model, "lm_head", None)):
        return f"{family}: lm_head is neither an edgeq quantised Linear nor a Linear"
    return None


def _is_linear(m) -> bool:
    """An edgeq quantised module with ``linear2d`` (Int4Linear, W4A8Linear) or a plain ``nn.Linear``."""
    return (getattr(m, "edgeq_quantized", False) and callable(getattr(m, "linear2d", None))) or isinstance(m, nn.Linear)


class _Layer:
    """References to one decoder layer's tensors and modules (no copies), and its slice of the KV cache."""

    __slots__ = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up", "fused", "separate", "w_in", "eps_in",
                 "w_post", "eps_post", "w_qn", "w_kn", "eps_qk", "window", "keys", "values", "cache_layer", "scale",
                 "eps_in_f", "eps_post_f")

    def __init__(self, layer: nn.Module, cache_layer, family: str, config, counts):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (_linear(m, counts) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.gate, self.up, self.down = (_linear(m, counts) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        # q/k/v and gate/up: one kernel call each where the modules can share one (edgeq.runtime.projections; the
        # same bits), else one per projection; LeanDecoder.fuse_projections picks (qkv, gate_up) from these two
        fns = [self.q.fn, self.k.fn, self.v.fn], [self.gate.fn, self.up.fn]
        self.fused = (projections.group([attn.q_proj, attn.k_proj, attn.v_proj], fns[0]),
                      projections.group([mlp.gate_proj, mlp.up_proj], fns[1]))
        self.separate = tuple(projections.separate(f) for f in fns)
        self.qkv, self.gate_up = self.fused
        self.w_in, self.eps_in = layer.input_layernorm.weight, _eps(layer.input_layernorm)
        self.w_post, self.eps_post = layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm)
        self.eps_in_f = float(layer.input_layernorm.variance_epsilon)  # the native ops take the Python float
        self.eps_post_f = float(layer.post_attention_layernorm.variance_epsilon)
        if family == "qwen3":
            self.w_qn, self.w_kn, self.eps_qk = attn.q_norm.weight, attn.k_norm.weight, _eps(attn.q_norm)
        else:
            self.w_qn = self.w_kn = self.eps_qk = None
        # Mistral applies config.sliding_window to every layer; Qwen2/3 set it per layer (None on full layers).
        window = getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        self.window = int(window) if window else None
        self.scale = float(attn.scaling)
        self.cache_layer = cache_layer
        self.keys, self.values = cache_layer.keys, cache_layer.values  # [1, kv_heads, capacity, d]


class _Linear:
    """One projection as the lean loop calls it: ``y [1, N] = x [1, K] @ W^T (+ b)``, a new tensor (the int4 kernel
    has no ``out=`` form). Int4Linear counts its own path; a bf16 reference Linear is counted here as ``bf16``."""

    __slots__ = ("fn", "out_features")

    def __init__(self, fn, out_features: int):
        self.fn, self.out_features = fn, out_features


def _linear(module: nn.Module, counts) -> _Linear:
    if getattr(module, "edgeq_quantized", False):
        return _Linear(module.linear2d, module.out_features)
    weight, bias = module.weight, module.bias

    def bf16(x):
        counts["bf16"] += 1
        return F.linear(x, weight, bias)

    return _Linear(bf16, module.out_features)


class LeanDecoder:
    """``step(token) -> logits [1, V]`` at position ``cache.length``, appending to the cache. One sequence."""

    def __init__(self, model: nn.Module, config, cache, max_model_len: int, counts, ops: str | None = None):
        self.family = config.model_type
        body = model.model
        self.cache = cache
        self.counts = counts
        self.embed_rows, self.dtype, self.embed = embedding.row_reader(body.embed_tokens)  # the table, never a copy
        self.layers = [_Layer(layer, cache.layers[i], self.family, config, counts) for i, layer in enumerate(body.layers)]
        self.w_final, self.eps_final = body.norm.weight, _eps(body.norm)
        self.eps_final_f = float(body.norm.variance_epsilon)
        self.head = _linear(model.lm_head, counts)
        attn0 = body.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.kv_heads = int(cache.layers[0].keys.shape[1])
        self.heads = self.layers[0].q.out_features // self.head_dim
        self.gqa = self.heads != self.kv_heads
        self.hidden = int(body.embed_tokens.embedding_dim)
        self.max_positions = int(max_model_len)
        self.threads = torch.get_num_threads()  # set once by load(); the loop never changes it
        ops, self.ops_reason = ops_choice(ops)
        # the native step's layers in one call where the modules allow (edgeq.runtime.stack; the same bits)
        self.stack_reason = stack.why_not(list(body.layers))
        self._stack_layers, self.stack, self._use_stack = list(body.layers), None, True  # built with the native buffers
        with torch.inference_mode(False):  # normal tensors: in-place writes bump their version (Runtime.gather keys on it)
            self._allocate(body.rotary_emb)
        if ops == "native":
            self.ops_reason += ("; the layers in one call (decode_layers)" if self.stack_reason is None else
                                f"; the layers op by op ({self.stack_reason})")
        self.ops = ops

    # ------------------------------------------------------------------------------------------------- buffers

    @property
    def ops(self) -> str:
        """The decode ops around the projections: "native" or "torch" (:func:`ops_choice`)."""
        return self._ops

    @ops.setter
    def ops(self, value: str) -> None:
        """Switch the ops (benchmarks time both on one load): a path's buffers are allocated at its first use."""
        with torch.inference_mode(False):
            self._buffers(value)
        self._ops = value

    def _allocate(self, rotary: nn.Module) -> None:
        """What both paths use: the RoPE tables, the residual, the norm's output, position/token indices, the
        position's cos/nsin rows, and Qwen3's head norm."""
        d, h, kvh, dt = self.head_dim, self.heads, self.kv_heads, self.dtype
        self.cos, self.nsin = rope_tables(rotary, self.max_positions, d, dt)
        self.x = torch.empty(1, self.hidden, dtype=dt)  # the residual stream
        self.n = torch.empty(1, self.hidden, dtype=dt)  # normed input of the projections
        self.pos, self.token = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        self.cos_p, self.nsin_p = torch.empty(1, d, dtype=dt), torch.empty(1, d, dtype=dt)
        self.norm = self.qk = self.qk_norm = self._qn_q = self._qn_k = self.rot = self.attn_out = None  # per path
        if self.family == "qwen3":
            self.qk_norm = _RMSNorm(h + kvh, d, dt)
            self._qn_q, self._qn_k = self.qk_norm.normed[:h], self.qk_norm.normed[h:]

    def _buffers(self, ops: str) -> None:
        """Allocate what ``ops`` needs that is not there yet. Native: the rotated q [h, d] (k goes straight into the
        cache), the attention's output and, where it runs, the one-call step's buffers (:mod:`.stack`). Torch: the
        RMSNorm's buffers, q|k's RoPE terms and result. Both: q|k when its head norm (Qwen3) or RoPE (torch) runs
        over it."""
        d, h, kvh, dt = self.head_dim, self.heads, self.kv_heads, self.dtype
        if self.qk is None and (ops == "torch" or self.family == "qwen3"):
            # q and k of one token side by side, so the head norm and RoPE run once over both: rows [:h] q, [h:] k.
            self.qk = torch.empty(h + kvh, d, dtype=dt)
            self._qk_q, self._qk_k = self.qk[:h], self.qk[h:]
        if ops == "native" and self.attn_out is None:
            self._rot_qh, self.attn_out = torch.empty(h, d, dtype=dt), torch.empty(h, d, dtype=dt)
            self._attn_flat = self.attn_out.view(1, h * d)  # the o projection's input
            if self.stack_reason is None:  # the layers in one call: its own one-token buffers
                self.stack = stack.Stack(self, self._stack_layers, self.w_final, self.eps_final_f)
        elif ops == "torch" and self.rot is None:
            self.norm = _RMSNorm(1, self.hidden, dt)
            self.t1, self.t2, self.rot = (torch.empty(h + kvh, d, dtype=dt) for _ in range(3))
            half = d // 2
            # views made once (a view per call costs about as much as a small op)
            self._qk_lo, self._qk_hi = self.qk[:, :half], self.qk[:, half:]
            self._t2_lo, self._t2_hi = self.t2[:, :half], self.t2[:, half:]
            self._nsin_lo, self._nsin_hi = self.nsin_p[:, :half], self.nsin_p[:, half:]
            self._rot_q = self.rot[:h].view(1, h, 1, d)
            self._rot_k = self.rot[h:].view(1, kvh, 1, d)  # index_copy_ source for the cache's [1, kv_heads, T, d]

    @property
    def fuse_projections(self) -> bool:
        """Whether q/k/v and gate/up run as one kernel call each where the modules allow it (the default; the same
        bits); False: one call per projection (benchmarks time one against the other)."""
        return self.layers[0].qkv is self.layers[0].fused[0] if self.layers else True

    @fuse_projections.setter
    def fuse_projections(self, value: bool) -> None:
        for L in self.layers:
            L.qkv, L.gate_up = L.fused if value else L.separate

    @property
    def native_layers(self) -> bool:
        """Whether the native step runs its layers in one ``decode_layers`` call (:mod:`edgeq.runtime.stack`; the
        default where the modules allow, the same bits); False: op by op from Python (benchmarks time both)."""
        return self.stack is not None and self._use_stack

    @native_layers.setter
    def native_layers(self, value: bool) -> None:
        self._use_stack = bool(value)

    @property
    def owned_bytes(self) -> int:
        """Bytes the decoder allocated (RoPE tables, one token's buffers); weights and the cache are not its own."""
        found = {}
        for holder in (self, self.norm, self.qk_norm):
            for v in vars(holder).values() if holder is not None else ():
                for t in v.values() if isinstance(v, dict) else (v,):
                    if isinstance(t, torch.Tensor) and t._base is None and t is not self.embed:
                        found[t.data_ptr()] = t.numel() * t.element_size()
        for t in self.stack.scratch if self.stack is not None else ():
            found[t.data_ptr()] = t.numel() * t.element_size()
        return sum(found.values())

    # ---------------------------------------------------------------------------------------------------- step

    def step(self, token: int) -> torch.Tensor:
        """Logits [1, V] (a new tensor) of ``token`` at position ``cache.length``; the cache grows by one."""
        cache = self.cache
        p = cache.length
        cache.check_room(1)
        if p >= self.max_positions:  # the cache is never larger than max_model_len; kept as a guard
            raise EdgeqError(f"position {p} is past the RoPE table of max_model_len={self.max_positions} positions")
        self.token.fill_(token)
        self.pos.fill_(p)
        self.embed_rows(self.token, self.x)
        torch.index_select(self.cos, 0, self.pos, out=self.cos_p)
        torch.index_select(self.nsin, 0, self.pos, out=self.nsin_p)
        if self._ops == "native":
            return self._step_native(p)
        x, n, norm = self.x, self.n, self.norm
        h, d = self.heads, self.head_dim
        end = p + 1
        for L in self.layers:
            norm(x, L.w_in, L.eps_in, n)
            self._qk_q.copy_(L.q.fn(n).view(h, d))
            self._qk_k.copy_(L.k.fn(n).view(-1, d))
            v = L.v.fn(n)
            if L.w_qn is not None:
                self._qk_norm(L)
            self._rope()
            L.keys.index_copy_(2, self.pos, self._rot_k)
            L.values.index_copy_(2, self.pos, v.view(1, -1, 1, d))
            L.cache_layer.length = end
            start = self._window_start(L, end)
            a = F.scaled_dot_product_attention(self._rot_q, L.keys.narrow(2, start, end - start),
                                               L.values.narrow(2, start, end - start), scale=L.scale,
                                               enable_gqa=self.gqa)
            x.add_(L.o.fn(a.reshape(1, h * d)))
            norm(x, L.w_post, L.eps_post, n)
            x.add_(L.down.fn(self._gated(L, n)))
        norm(x, self.w_final, self.eps_final, n)
        return self.head.fn(n)

    def _step_native(self, p: int) -> torch.Tensor:
        """The same step with edgeq's native ops: 10 ops a layer (4 kernel calls for the 7 projections: q/k/v and
        gate/up each in one, :mod:`edgeq.runtime.projections`, where the modules allow) instead of ~50. The
        residual add of each block is fused into the next norm (``add_rms_norm(x, delta, ...)``). Where the modules
        allow (:mod:`edgeq.runtime.stack`), the loop below runs in C++ in one call, op for op: the same bits."""
        x, n = self.x, self.n
        h, d = self.heads, self.head_dim
        end = p + 1
        if self.native_layers and self.stack.usable:
            self.stack(p)  # every layer and the final norm in one call: the loop below, op for op, in C++
            for L in self.layers:
                L.cache_layer.length = end
            return self.head.fn(n)
        cos, nsin, rot_q, out = self.cos_p, self.nsin_p, self._rot_qh, self.attn_out
        delta = None
        for L in self.layers:
            native.add_rms_norm(x, delta, L.w_in, L.eps_in_f, n)
            q, k, v = L.qkv(n)
            if L.w_qn is not None:
                self._qk_q.copy_(q.view(h, d))
                self._qk_k.copy_(k.view(-1, d))
                self._qk_norm(L)
                q, k = self._qk_q, self._qk_k
            native.rope_to_cache(q, k, v, cos, nsin, L.keys, L.values, p, rot_q)
            L.cache_layer.length = end
            native.decode_attn(rot_q, L.keys, L.values, self._window_start(L, end), end, L.scale, out)
            native.add_rms_norm(x, L.o.fn(self._attn_flat), L.w_post, L.eps_post_f, n)
            delta = L.down.fn(self._gated(L, n))
        native.add_rms_norm(x, delta, self.w_final, self.eps_final_f, n)
        return self.head.fn(n)

    @staticmethod
    def _window_start(L: _Layer, end: int) -> int:
        return end - L.window if L.window is not None and end > L.window else 0

    @staticmethod
    def _gated(L: _Layer, n: torch.Tensor) -> torch.Tensor:
        """silu(n @ Wg^T) * (n @ Wu^T), in place on the gate's output."""
        g, u = L.gate_up(n)
        F.silu(g, inplace=True)
        return g.mul_(u)

    def _qk_norm(self, L: _Layer) -> None:
        """Qwen3: RMSNorm over each head of q and k (rows of ``qk``), in place."""
        self.qk_norm.unweighted(self.qk, L.eps_qk)
        torch.mul(L.w_qn, self._qn_q, out=self._qk_q)
        torch.mul(L.w_kn, self._qn_k, out=self._qk_k)

    def _rope(self) -> None:
        """rot = qk * cos[p] + swap_halves(qk) * nsin[p]: transformers' apply_rotary_pos_emb, bit for bit."""
        torch.mul(self.qk, self.cos_p, out=self.t1)
        torch.mul(self._qk_hi, self._nsin_lo, out=self._t2_lo)
        torch.mul(self._qk_lo, self._nsin_hi, out=self._t2_hi)
        torch.add(self.t1, self.t2, out=self.rot)


def ops_choice(request: str | None) -> tuple[str, str]:
    """("native" | "torch", why): which ops run the decode step around the projections.

    ``request``: "auto" (None reads ``$EDGEQ_DECODE_OPS``, default auto) takes edgeq's native decode ops when the
    native library runs here, else torch's; "native" requires them; "torch" keeps the eager torch ops (SDPA, the
    8-op RMSNorm, 4-op RoPE), whose logits are bit-identical to the transformers forward. The native ops
    (``edgeq.runtime.native``: ``decode_attn``, ``add_rms_norm``, ``rope_to_cache``) make the same roundings except
    two sums taken in another order (the attention's, in fp32 with one final rounding, and the RMSNorm's sum of
    squares), so the logits are close, not bit-equal: the reason it is a choice. Why they exist: torch's
    flash-attention CPU kernel is built for many queries (for one query it was half of a decode step), and ~50
    eager ops a layer cost more in dispatch than in arithmetic (docs/kernel.md, "Decode breakdown").
    """
    picked, source = choice(request, "decode_ops", ENV_DECODE_OPS, DECODE_OPS)
    if picked == "torch":
        return "torch", f"requested ({source}=torch)"
    if native.available():
        return "native", f"edgeq's decode ops: attention, RMSNorm, RoPE + cache write ({native.status().get('isa')})"
    why = native.status().get("reason", "unavailable")
    if picked == "native":
        raise EdgeqError(f"{source}=native but the native library does not run here: {why}; use auto or torch")
    return "torch", f"native library unavailable ({why})"
