"""edgeq fidelity: statistics against hand-worked and numpy references, windowing, --ref files, per-layer, CLI."""

from __future__ import annotations

import copy
import gc
import itertools
import json
import math
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgeq.fidelity import checkpoints, metrics
from edgeq.fidelity.checkpoints import check_order, run_fidelity
from edgeq.fidelity.metrics import position_stats, top_n_mask
from edgeq.fidelity.reffile import load_reference_file
from edgeq.fidelity.report import FidelityReport, render
from edgeq.fidelity.run import compare, compare_to_reference_file, save_reference_file
from edgeq.fidelity.stats import summarize
from edgeq.fidelity.text import Windowing, make_windows, plan_counts
from edgeq.fidelity.thresholds import broken_bounds
from edgeq.fidelity.tokens import tokenizer_sha256
from edgeq.fidelity.topk import position_stats_topk, ref_rows, worst_tail_kl
from edgeq.keys import DATA
from edgeq.errors import EdgeqError
from helpers.cli import run_cli

V = 48  # fake vocabulary: "<bos>", "<eos>", then words w2..w47


# ---------------------------------------------------------------------------------------------------------- fakes
class FakeTokenizer:
    """Whitespace tokenizer over a fixed word list: enough of the transformers interface for fidelity."""

    def __init__(self, words: list[str], bos: int | None = 0):
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.bos_token_id, self.eos_token_id = bos, 1

    def get_vocab(self) -> dict[str, int]:
        return dict(self.index)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.index[w] for w in text.split()]


WORDS = ["<bos>", "<eos>"] + [f"w{i}" for i in range(2, V)]


def make_text(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(2, V, size=n))


class QLinear(torch.nn.Linear):
    """Stands in for a runtime quantised linear: only the class marker matters to fidelity."""

    edgeq_quantized = True


class TinyLM(torch.nn.Module):
    """Causal toy LM: embedding, running mean over the prefix, two named linears, a head."""

    def __init__(self, seed: int = 0, d: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(V, d)
        self.body = torch.nn.Sequential()
        self.body.add_module("fc1", torch.nn.Linear(d, d))
        self.body.add_module("act", torch.nn.Tanh())
        self.body.add_module("fc2", torch.nn.Linear(d, d))
        self.head = torch.nn.Linear(d, V, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, input_ids: torch.Tensor):
        x = self.embed(input_ids)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]
        return SimpleNamespace(logits=self.head(x + self.body(x)))


def quantised_copy(model: TinyLM, noise: float, seed: int = 1, names=("body.fc1", "body.fc2", "head")) -> TinyLM:
    """A copy whose named linears become QLinear with relative Gaussian weight noise ``noise``."""
    q = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = q.get_submodule(parent_name) if parent_name else q
        old = getattr(parent, child)
        new = QLinear(old.in_features, old.out_features, bias=old.bias is not None)
        with torch.no_grad():
            new.weight.copy_(old.weight * (1 + noise * torch.randn(old.weight.shape, generator=g)))
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, child, new)
    return q


def side(model, tok=None):
    return SimpleNamespace(model=model, tokenizer=tok or FakeTokenizer(WORDS))


# -------------------------------------------------------------------------------------------------- hand-checked
def test_hand_worked_kld_and_stats_match_numpy():
    # position 0: p = (1/2, 1/4, 1/8, 1/8), q uniform -> KL = 1/2 ln2 + 2 * 1/8 ln(1/2) = ln2 / 4
    p0 = np.array([0.5, 0.25, 0.125, 0.125])
    ref = np.log(np.stack([p0, [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    quant = np.log(np.stack([[0.25] * 4, [0.4, 0.4, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    targets = np.array([1, 0, 3])
    ref32, quant32 = (ref + 3.0).astype(np.float32), (quant - 1.0).astype(np.float32)  # logits up to a constant
    cols = position_stats(torch.from_numpy(ref32), torch.from_numpy(quant32), torch.tensor(targets))
    assert cols["kld"][0] == pytest.approx(math.log(2) / 4, rel=1e-6)

    # independent numpy reference from float32-rounded logits, float64 arithmetic
    def lsm(x):
        x = x.astype(np.float64)
        return x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    lr, lq = lsm(ref32), lsm(quant32)
    kld = (np.exp(lr) * (lr - lq)).sum(1)
    nll_r, nll_q = -lr[np.arange(3), targets], -lq[np.arange(3), targets]
    dp = np.exp(-nll_q) - np.exp(-nll_r)
    np.testing.assert_allclose(cols["kld"], kld, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(cols["nll_ref"], nll_r, rtol=1e-9)
    np.testing.assert_allclose(cols["nll_quant"], nll_q, rtol=1e-9)
    np.testing.assert_allclose(cols["delta_p"], dp, rtol=1e-9, atol=1e-12)
    # top-1: pos 0 ref argmax 0, quant ties -> first index 0: same; pos 1: 0 vs 0 same; pos 2: 0 vs 3 differ
    np.testing.assert_array_equal(cols["top1_same"], [1.0, 1.0, 0.0])

    rep = summarize(cols, ctx=8, score="half", windows=1, partial=False)
    n = 3
    # llama-perplexity's forms: se = sqrt((<x^2> - <x>^2) / (n - 1)), cov-aware ratio error
    se = lambda x: math.sqrt(((x ** 2).mean() - x.mean() ** 2) / (n - 1))
    cov = ((nll_q * nll_r).mean() - nll_q.mean() * nll_r.mean()) / (n - 1)
    ln_se = math.sqrt(se(nll_q) ** 2 + se(nll_r) ** 2 - 2 * cov)
    assert rep.tokens_scored == 3
    assert rep.ppl_ref == pytest.approx(math.exp(nll_r.mean()), rel=1e-12)
    assert rep.ppl_quant_err == pytest.approx(math.exp(nll_q.mean()) * se(nll_q), rel=1e-9)
    assert rep.ln_ppl_ratio == pytest.approx(nll_q.mean() - nll_r.mean(), rel=1e-12)
    assert rep.ln_ppl_ratio_err == pytest.approx(ln_se, rel=1e-9)
    assert rep.ppl_ratio_err == pytest.approx(rep.ppl_ratio * ln_se, rel=1e-9)
    assert rep.nll_correlation == pytest.approx(cov / (se(nll_q) * se(nll_r)), rel=1e-9)
    assert rep.kld_mean == pytest.approx(kld.mean(), rel=1e-12)
    assert rep.kld_mean_err == pytest.approx(se(kld), rel=1e-9)
    assert rep.kld_median == pytest.approx(np.sort(kld)[1], rel=1e-12)
    s = np.sort(kld)  # p90 of 3 values: position 0.9 * 2 = 1.8 between s[1] and s[2]
    assert rep.kld_p90 == pytest.approx(s[1] + 0.8 * (s[2] - s[1]), rel=1e-12)
    assert rep.kld_max == pytest.approx(s[2], rel=1e-12)
    assert rep.top1_agreement == pytest.approx(2 / 3)
    assert rep.top1_agreement_err == pytest.approx(math.sqrt(2 / 3 * 1 / 3 / 2))
    rms = math.sqrt((dp ** 2).mean())
    assert rep.delta_p_rms == pytest.approx(rms, rel=1e-12)
    assert rep.delta_p_rms_err == pytest.approx(se(dp ** 2) / (2 * rms), rel=1e-9)
    assert rep.kld_topk_bound is None and rep.ref_topk is None


def test_top5_overlap_counts_shared_ids():
    ref = torch.arange(8, dtype=torch.float32)[None]  # top-5 ids {7,6,5,4,3}
    quant = torch.tensor([[9.0, 8, 7, 0, 0, 0, 6, 5]])  # top-5 ids {0,1,2,6,7}: shares 6 and 7
    cols = position_stats(ref, quant, torch.tensor([0]))
    assert cols["top5_overlap"][0] == pytest.approx(2 / 5)


def test_top_n_sets_break_ties_towards_low_ids():
    m = top_n_mask(torch.tensor([[1.0, 3, 3, 3, 0], [5, 5, 5, 5, 5]]), 2)
    assert m.tolist() == [[False, True, True, False, False], [True, True, False, False, False]]
    # tied logits: the overlap does not depend on how torch.topk happens to order ties
    r = torch.tensor([[2.0, 1, 1, 1, 1, 1, 1, 0]])
    q = torch.tensor([[2.0, 1, 1, 1, 1, 1, 1, 0]]).flip(-1).flip(-1)
    assert position_stats(r, q, torch.tensor([0]))["top5_overlap"][0] == 1.0


def test_kld_ignores_zero_probability_entries_and_is_infinite_where_quant_has_none():
    ref = torch.tensor([[0.0, 0.0, -math.inf]])
    same = position_stats(ref, ref.clone(), torch.tensor([0]))
    assert same["kld"][0] == 0.0
    broken = position_stats(torch.tensor([[0.0, 0.0, 0.0]]), ref, torch.tensor([0]))
    assert broken["kld"][0] == math.inf


def test_position_stats_is_blockwise_invariant(monkeypatch):
    g = torch.Generator().manual_seed(3)
    r, q = torch.randn(37, V, generator=g), torch.randn(37, V, generator=g)
    t = torch.randint(0, V, (37,), generator=g)
    whole = position_stats(r, q, t)
    monkeypatch.setattr(metrics, "_BLOCK_ELEMENTS", 5 * V)  # 5 rows per block, last block shorter
    blocked = position_stats(r, q, t)
    for k in whole:
        np.testing.assert_array_equal(whole[k], blocked[k])


# --------------------------------------------------------------------------------------------------- windowing
def test_windows_with_and_without_bos():
    w = make_windows(list(range(10)), 4, bos_id=99)
    assert w.tolist() == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8]]
    assert make_windows(list(range(10)), 4, bos_id=None).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(EdgeqError, match="tokenises to 3 tokens.*--ctx 8"):
        make_windows([1, 2, 3], 8, bos_id=0)


def test_scored_positions_per_mode_and_max_tokens():
    assert Windowing(512, "half").per_window == 255  # llama-perplexity: n_ctx - 1 - n_ctx/2
    assert Windowing(512, "all").per_window == 511
    assert plan_counts(4, 10, None) == [10, 10, 10, 10]
    assert plan_counts(4, 10, 25) == [10, 10, 5]
    assert plan_counts(2, 10, 1000) == [10, 10]
    with pytest.raises(EdgeqError, match="--score 'some'"):
        Windowing(512, "some")
    with pytest.raises(EdgeqError, match="--ctx 2"):
        Windowing(2, "half")


def test_scores_exactly_the_second_half_of_each_window():
    calls = []

    def scorer(ids):
        calls.append(ids.clone())
        logits = torch.full((1, ids.shape[1], V), -20.0)
        logits[0, torch.arange(ids.shape[1]), ids[0]] = 0.0  # predicts "same token again"
        return logits

    ids = list(range(2, 2 + 7 * 3))  # bos + 7 tokens per window of 8 -> 3 windows
    rep = compare(scorer, scorer, input_ids=ids, tokenizer=FakeTokenizer(WORDS), ctx=8, score="half")
    assert rep.windows == 3 and rep.tokens_scored == 3 * 3  # rows 4, 5, 6 of each window
    assert [c[0, 0].item() for c in calls] == [0] * 6  # every window starts with BOS
    assert calls[0][0, 1:].tolist() == ids[:7]
    rep_all = compare(scorer, scorer, input_ids=ids, tokenizer=FakeTokenizer(WORDS), ctx=8, score="all",
                        max_tokens=10)
    assert rep_all.tokens_scored == 10 and rep_all.windows == 2


@pytest.mark.slow
def test_streams_one_window_at_a_time():
    """No full-vocabulary logits of an earlier window survive into the next window's forward passes."""
    alive: list[weakref.ref] = []
    model = TinyLM()

    def scorer(ids):
        gc.collect()
        older = [r for r in alive[:-1] if r() is not None]  # at most the other model's logits of this window
        assert not older, f"{len(older)} logits tensors of earlier windows still alive"
        out = model(ids).logits
        alive.append(weakref.ref(out))
        return out

    rep = compare(scorer, scorer, text=make_text(160), tokenizer=FakeTokenizer(WORDS), ctx=32)
    assert rep.windows == 5 and len(alive) == 10


# ------------------------------------------------------------------------------------------------ model behaviour
def test_identical_models_give_zero_kld_and_full_agreement():
    model = TinyLM()
    for other in (model, copy.deepcopy(model)):
        rep = compare(side(model), side(other), text=make_text(600), ctx=32)
        assert rep.kld_mean == 0.0 and rep.kld_max == 0.0 and rep.kld_p999 == 0.0
        assert rep.top1_agreement == 1.0 and rep.top5_overlap == 1.0
        assert rep.ppl_ratio == 1.0 and rep.ln_ppl_ratio == 0.0
        assert rep.delta_p_rms == 0.0 and rep.delta_p_rms_err == 0.0
        assert rep.ppl_ref == rep.ppl_quant and not rep.partial


def test_stronger_perturbation_gives_larger_kld():
    model = TinyLM()
    text = make_text(800)
    light = compare(side(model), side(quantised_copy(model, 0.02)), text=text, ctx=32)
    strong = compare(side(model), side(quantised_copy(model, 0.3)), text=text, ctx=32)
    assert 0 < light.kld_mean < strong.kld_mean
    assert light.kld_mean + 3 * light.kld_mean_err < strong.kld_mean - 3 * strong.kld_mean_err
    assert light.top1_agreement >= strong.top1_agreement
    assert light.delta_p_rms < strong.delta_p_rms


def test_interrupt_returns_partial_statistics():
    model = TinyLM()
    n = {"calls": 0}

    def flaky(ids):
        n["calls"] += 1
        if n["calls"] == 3:  # the reference's forward of the third window
            raise KeyboardInterrupt
        return model(ids).logits

    seen = []
    rep = compare(flaky, model, text=make_text(400), tokenizer=FakeTokenizer(WORDS), ctx=32,
                    progress=lambda d, t, eta: seen.append((d, t)))
    assert rep.partial and rep.windows == 2 and rep.tokens_scored == 2 * 15
    assert seen == [(1, 12), (2, 12)]
    assert rep.to_dict()["partial"] is True


def test_interrupt_before_any_window_propagates():
    def scorer(ids):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compare(scorer, scorer, text=make_text(100), tokenizer=FakeTokenizer(WORDS), ctx=32)


# ------------------------------------------------------------------------------------------- vocabulary checks
def test_refuses_different_vocab_size():
    a = SimpleNamespace(model=TinyLM(), tokenizer=FakeTokenizer(WORDS), config={"vocab_size": V})
    b = SimpleNamespace(model=TinyLM(), tokenizer=FakeTokenizer(WORDS), config={"vocab_size": V + 16})
    with pytest.raises(EdgeqError, match=f"vocab size differs: reference {V}, quantised {V + 16}"):
        compare(a, b, text=make_text(100), ctx=32)


def test_refuses_ctx_beyond_the_models_positions():
    a = SimpleNamespace(model=TinyLM(), tokenizer=FakeTokenizer(WORDS), config={"max_position_embeddings": 16})
    with pytest.raises(EdgeqError, match="--ctx 32: the reference model has max_position_embeddings 16; use --ctx 16"):
        compare(a, side(TinyLM()), text=make_text(100), ctx=32)


def test_refuses_different_logit_width():
    small = lambda ids: torch.zeros(1, ids.shape[1], V)
    wide = lambda ids: torch.zeros(1, ids.shape[1], V + 1)
    with pytest.raises(EdgeqError, match=f"reference model has {V} logits, the quantised model {V + 1}"):
        compare(small, wide, text=make_text(100), tokenizer=FakeTokenizer(WORDS), ctx=32)


def test_refuses_tokenizer_with_a_different_token():
    other = list(WORDS)
    other[17] = "zz"
    with pytest.raises(EdgeqError, match="tokenizer differs at token id 17: reference 'w17', quantised 'zz'"):
        compare(side(TinyLM()), side(TinyLM(), FakeTokenizer(other)), text=make_text(100), ctx=32)


def test_refuses_tokenizer_of_another_size_or_bos():
    with pytest.raises(EdgeqError, match=f"reference has {V} token ids, quantised {V - 1}"):
        compare(side(TinyLM()), side(TinyLM(), FakeTokenizer(WORDS[:-1])), text=make_text(100), ctx=32)
    with pytest.raises(EdgeqError, match="bos_token_id is 0 in the reference, None in the quantised"):
        compare(side(TinyLM()), side(TinyLM(), FakeTokenizer(WORDS, bos=None)), text=make_text(100), ctx=32)


def test_refuses_tokenizer_that_splits_the_text_differently():
    class Merging(FakeTokenizer):
        def encode(self, text, add_special_tokens=False):
            ids = super().encode(text)
            return [i for i in ids if i != 5]  # same vocabulary, different segmentation

    text = make_text(100)
    k = super(Merging, Merging(WORDS)).encode(text).index(5)
    with pytest.raises(EdgeqError, match=f"tokenises differently at token {k} \\(reference id 5"):
        compare(side(TinyLM()), side(TinyLM(), Merging(WORDS)), text=text, ctx=32)


# ----------------------------------------------------------------------------------------------- --ref files
def brute_force_worst_tail(logb: np.ndarray, m: float) -> float:
    """max KL(a || b) over 0 <= a <= m, sum a = 1, by enumerating the polytope's vertices."""
    n, best = len(logb), -math.inf
    c = int(math.floor(1 / m))
    r = 1 - c * m
    for full in itertools.permutations(range(n), min(c + 1, n)):
        a = np.zeros(n)
        a[list(full[:c])] = m
        if len(full) > c:
            a[full[c]] = r
        if abs(a.sum() - 1) > 1e-12:
            continue
        nz = a > 0
        best = max(best, float((a[nz] * (np.log(a[nz]) - logb[nz])).sum()))
    return best


def test_worst_tail_kl_matches_vertex_enumeration():
    rng = np.random.default_rng(0)
    for m in (1.0, 0.5, 0.4, 0.3, 0.26):
        logits = rng.normal(size=5) * 2
        logb = logits - np.log(np.exp(logits).sum())
        got = worst_tail_kl(torch.tensor(logb)[None], torch.tensor([m], dtype=torch.float64))
        assert float(got[0]) == pytest.approx(brute_force_worst_tail(logb, m), rel=1e-9, abs=1e-12)
    # entries outside the tail (+inf) are never chosen; worked example from the docstring
    half = worst_tail_kl(torch.tensor([[math.log(0.25)] * 4 + [math.inf]]), torch.tensor([0.5], dtype=torch.float64))
    assert float(half[0]) == pytest.approx(math.log(2))


def test_topk_kld_hand_worked():
    # p = (1/2, 1/4, 1/8, 1/8), q uniform, k = 2: head 1/2 ln(2) + 1/4 ln(1), tail P_T = 1/4, Q_T = 1/2:
    # lump 1/4 ln(1/2) -> kld_k = ln2/4, exact here because both tails are uniform. m = p_(2) / P_T = 1, so the
    # worst tail puts all of P_T on one token: bound = 1/4 KL((1, 0) || (1/2, 1/2)) = ln2/4.
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    quant = torch.zeros(1, 4)
    t = torch.tensor([2])
    rows = ref_rows(ref, t, 2)
    assert rows.topk_ids.tolist() == [[0, 1]] and rows.top1.tolist() == [0]
    assert float(rows.tail_logmass[0]) == pytest.approx(math.log(0.25))
    assert float(rows.target_logprob[0]) == pytest.approx(math.log(0.125))
    got = position_stats_topk(rows, quant, t)
    assert got["kld"][0] == pytest.approx(math.log(2) / 4, rel=1e-6)  # float32 logits
    assert got["kld_bound"][0] == pytest.approx(math.log(2) / 4, rel=1e-6)
    assert got["tail_mass"][0] == pytest.approx(0.25)
    # a tail that is not proportional: q = (1/4, 1/4, 0.4, 0.1); exact minus kld_k = P_T KL((1/2,1/2) || (0.8,0.2))
    quant2 = torch.log(torch.tensor([[0.25, 0.25, 0.4, 0.1]]))
    exact = position_stats(ref, quant2, t)["kld"][0]
    approx = position_stats_topk(rows, quant2, t)
    cond = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert exact - approx["kld"][0] == pytest.approx(0.25 * cond, rel=1e-6)
    assert approx["kld_bound"][0] == pytest.approx(0.25 * math.log(1 / 0.2), rel=1e-6)  # all tail mass on q=0.1


def test_topk_kld_is_a_lower_bound_within_the_stated_bound():
    g = torch.Generator().manual_seed(7)
    S, Vb = 64, 40
    r = torch.randn(S, Vb, generator=g) * 2
    for scale in (0.05, 0.5, 2.0, "ties"):
        if scale == "ties":  # coarse logits, as bf16 gives: many ties at the top-5 and top-k boundaries
            r = (r * 2).round() / 2
            q = (r + 0.3 * torch.randn(S, Vb, generator=g)).mul(2).round() / 2
        else:
            q = r + scale * torch.randn(S, Vb, generator=g)
        t = torch.randint(0, Vb, (S,), generator=g)
        full = position_stats(r, q, t)
        for k in (5, 12, Vb):
            approx = position_stats_topk(ref_rows(r, t, k), q, t)
            short = full["kld"] - approx["kld"]
            assert (short >= -1e-12).all()
            assert (short <= approx["kld_bound"] + 1e-12).all()
            for name in ("nll_ref", "nll_quant", "delta_p", "top1_same", "top5_overlap"):
                np.testing.assert_allclose(approx[name], full[name], rtol=1e-12, atol=1e-15)
            if k == Vb:  # nothing outside the top k: exact
                np.testing.assert_allclose(approx["kld"], full["kld"], rtol=1e-9, atol=1e-12)
                assert (approx["kld_bound"] == 0).all() and (approx["tail_mass"] == 0).all()


def test_ref_file_round_trip_reproduces_the_full_comparison(tmp_path):
    model = TinyLM()
    quant = quantised_copy(model, 0.1)
    text = make_text(700)
    path = tmp_path / "ref.safetensors"
    full = compare(side(model), side(quant), text=text, ctx=32, save_ref=path, ref_topk=8)
    cached = compare_to_reference_file(path, side(quant), text=text)
    assert cached.ref_topk == 8 and cached.windows == full.windows and cached.tokens_scored == full.tokens_scored
    for name in ("ppl_ref", "ppl_quant", "ppl_ratio", "ln_ppl_ratio_err", "top1_agreement", "top5_overlap",
                 "delta_p_rms", "delta_p_rms_err"):
        assert getattr(cached, name) == pytest.approx(getattr(full, name), rel=1e-12), name
    assert cached.kld_mean <= full.kld_mean + 1e-15
    assert full.kld_mean - cached.kld_mean <= cached.kld_topk_bound
    assert 0 < cached.ref_tail_mass < 1
    # the same model against its own cache: KLD exactly 0, no shortfall
    self_cmp = compare_to_reference_file(path, side(model))
    assert self_cmp.kld_mean == 0.0 and self_cmp.top1_agreement == 1.0 and self_cmp.kld_max == 0.0
    # --max-tokens takes a prefix of the cached positions
    assert compare_to_reference_file(path, side(quant), max_tokens=20).tokens_scored == 20


def test_save_reference_alone_matches(tmp_path):
    model = TinyLM()
    text = make_text(300)
    path = tmp_path / "r.safetensors"
    n, ppl = save_reference_file(side(model), path, text=text, ctx=32, k=6)
    full = compare(side(model), side(model), text=text, ctx=32)
    assert n == full.tokens_scored and ppl == pytest.approx(full.ppl_ref, rel=1e-12)
    ref = load_reference_file(path)
    h = ref.header
    assert (h["format"], h["ctx"], h["score"], h["k"], h["vocab_size"], h["bos_id"]) == \
           ("edgeq.fidelity-ref/1", 32, "half", 6, V, 0)
    assert h["positions"] == n and ref.rows.topk_ids.dtype == torch.int32
    assert ref.rows.topk_logprobs.dtype == torch.float64 and ref.windows.shape == (h["windows"], 32)


def test_truncated_ref_file_is_refused(tmp_path):
    path = tmp_path / "ref.safetensors"
    save_reference_file(side(TinyLM()), path, text=make_text(300), ctx=32)
    data = path.read_bytes()
    for cut in (len(data) - 100, 40, 3):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        with pytest.raises(EdgeqError, match=f"{bad}: unreadable or truncated reference file .*--save-ref"):
            compare_to_reference_file(bad, side(TinyLM()))
    with pytest.raises(EdgeqError, match="reference file not found"):
        compare_to_reference_file(tmp_path / "nope", side(TinyLM()))


def test_a_reference_file_that_changed_is_refused(tmp_path):
    """A flipped byte in its logprobs would give a plausible, wrong KLD: the header's sha256 of the data catches it."""
    from safetensors import safe_open

    path = tmp_path / "ref.safetensors"
    save_reference_file(side(TinyLM()), path, text=make_text(300), ctx=32)
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()  # as any new file, not mkstemp's 0600
    compare_to_reference_file(path, side(TinyLM()))  # intact: it loads
    with safe_open(str(path), framework="pt") as f:
        start = len(path.read_bytes()) - f.get_tensor("top1").numel() * f.get_tensor("top1").element_size()
    data = bytearray(path.read_bytes())
    data[start + 1] ^= 0x40  # inside the data, after the header: still a readable safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(EdgeqError, match=f"{path}: its data does not match the sha256 in its header"):
        compare_to_reference_file(path, side(TinyLM()))


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_mismatched_ref_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    text = make_text(300)
    path = tmp_path / "ref.safetensors"
    save_reference_file(side(TinyLM()), path, text=text, ctx=32)
    with pytest.raises(EdgeqError, match=f"{path}: made from another text"):
        compare_to_reference_file(path, side(TinyLM()), text=make_text(300, seed=1))
    with pytest.raises(EdgeqError, match="made with --ctx 32, asked for --ctx 64"):
        compare_to_reference_file(path, side(TinyLM()), ctx=64)
    with pytest.raises(EdgeqError, match="made with --score half, asked for --score all"):
        compare_to_reference_file(path, side(TinyLM()), score="all")
    other = list(WORDS)
    other[3] = "x"
    with pytest.raises(EdgeqError, match="made with a different tokenizer"):
        compare_to_reference_file(path, side(TinyLM(), FakeTokenizer(other)))
    wide = lambda ids: torch.zeros(1, ids.shape[1], V + 2)
    with pytest.raises(EdgeqError, match=f"reference file was made with {V} logits, the quantised model has {V + 2}"):
        compare_to_reference_file(path, wide)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(EdgeqError, match="not an edgeq fidelity reference file"):
        compare_to_reference_file(plain, side(TinyLM()))


# --------------------------------------------------------------------------------------------------- per-layer
def direct_layer_errors(ref: TinyLM, quant: TinyLM, windows: torch.Tensor, first: int, names) -> dict:
    """||y_q - y_ref|| / ||y_ref|| over rows first..ctx-2, from outputs captured by hand (no fidelity code)."""
    def capture(model):
        outs = {n: [] for n in names}
        hs = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: outs[n].append(o[:, first:-1]))
              for n in names]
        with torch.no_grad():
            for w in windows:
                model(w[None])
        for h in hs:
            h.remove()
        return {n: torch.cat(v, 1).double() for n, v in outs.items()}
    yr, yq = capture(ref), capture(quant)
    return {n: float((yq[n] - yr[n]).norm() / yr[n].norm()) for n in names}


def test_per_layer_relative_errors_match_direct_computation():
    model = TinyLM()
    names = ("body.fc1", "body.fc2", "head")
    quant = quantised_copy(model, 0.1, names=("body.fc1", "head"))  # fc2 stays a plain Linear
    text = make_text(400)
    rep = compare(side(model), side(quant), text=text, ctx=32, per_layer=True, top=10)
    assert rep.per_layer_count == 2 and {e.name for e in rep.per_layer} == {"body.fc1", "head"}
    assert [e.rel_err for e in rep.per_layer] == sorted((e.rel_err for e in rep.per_layer), reverse=True)
    windows = make_windows(FakeTokenizer(WORDS).encode(text), 32, 0)
    direct = direct_layer_errors(model, quant, windows, 16, names)
    got = {e.name: e for e in rep.per_layer}
    for n in ("body.fc1", "head"):
        assert got[n].rel_err == pytest.approx(direct[n], rel=1e-5)
    # fc1 sees the same input in both models, so its local error equals its end-to-end error
    assert got["body.fc1"].local_rel_err == pytest.approx(got["body.fc1"].rel_err, rel=1e-5)
    # the head's local error: the quantised head applied to the reference head's input
    xs = []
    h = model.head.register_forward_hook(lambda m, i, o: xs.append(i[0][:, 16:-1]))
    with torch.no_grad():
        for w in windows:
            model(w[None])
        h.remove()
        x = torch.cat(xs, 1)
        local = float((quant.head(x) - model.head(x)).double().norm() / model.head(x).double().norm())
    assert got["head"].local_rel_err == pytest.approx(local, rel=1e-5)
    assert got["head"].local_rel_err != pytest.approx(got["head"].rel_err, rel=1e-3)
    assert direct["body.fc2"] > 0  # fc2 is perturbed downstream but is not reported: it is not quantised
    assert len(compare(side(model), side(quant), text=text, ctx=32, per_layer=True, top=1).per_layer) == 1
    # hooks are removed afterwards
    assert not quant.head._forward_hooks and not model.head._forward_hooks


def test_interrupt_keeps_per_layer_and_token_statistics_consistent():
    class Interrupting(TinyLM):
        calls = 0

        def forward(self, input_ids):
            out = super().forward(input_ids)  # every hook of this window has fired
            Interrupting.calls += 1
            if Interrupting.calls == 3:
                raise KeyboardInterrupt
            return out

    model = Interrupting()
    quant = quantised_copy(TinyLM(), 0.1)  # same seed, same weights; a plain TinyLM that never interrupts
    text = make_text(400)
    cut = compare(side(model), side(quant), text=text, ctx=32, per_layer=True)
    clean = compare(side(TinyLM()), side(quant), text=text, ctx=32, per_layer=True, max_tokens=2 * 15)
    assert cut.partial and cut.windows == 2 and not clean.partial
    assert cut.kld_mean == clean.kld_mean
    assert [(e.name, e.rel_err, e.local_rel_err) for e in cut.per_layer] == \
           [(e.name, e.rel_err, e.local_rel_err) for e in clean.per_layer]


def test_per_layer_refusals():
    model = TinyLM()
    with pytest.raises(EdgeqError, match="no module marked edgeq_quantized"):
        compare(side(model), side(copy.deepcopy(model)), text=make_text(100), ctx=32, per_layer=True)
    renamed = quantised_copy(model, 0.1, names=("head",))
    renamed.out = renamed.head
    del renamed.head
    renamed.forward = lambda input_ids: SimpleNamespace(logits=renamed.out(renamed.embed(input_ids)))
    with pytest.raises(EdgeqError, match="quantised module out has no same-named module in the reference"):
        compare(side(model), side(renamed), text=make_text(100), ctx=32, per_layer=True)
    with pytest.raises(EdgeqError, match="needs both models as nn.Modules"):
        compare(model, lambda ids: model(ids).logits, text=make_text(100), tokenizer=FakeTokenizer(WORDS), ctx=32,
                  per_layer=True)


# ------------------------------------------------------------------------------------------- thresholds, JSON
def report_for(kld=0.01, top1=0.95, ratio=1.01) -> FidelityReport:
    rep = compare(side(TinyLM()), side(TinyLM()), text=make_text(200), ctx=32)
    return FidelityReport(**{**rep.__dict__, "kld_mean": kld, "top1_agreement": top1, "ppl_ratio": ratio})


def test_thresholds_name_the_broken_bound():
    rep = report_for()
    assert broken_bounds(rep) == []
    assert broken_bounds(rep, max_kld=0.02, min_top1=0.9, max_ppl_ratio=1.02) == []
    assert broken_bounds(rep, max_kld=0.005) == ["mean KLD 0.01 > --max-kld 0.005"]
    assert broken_bounds(rep, min_top1=0.99) == ["same top-1 0.95 < --min-top1 0.99"]
    assert broken_bounds(rep, max_ppl_ratio=1.001) == ["PPL ratio 1.01 > --max-ppl-ratio 1.001"]
    assert len(broken_bounds(rep, max_kld=0.0, min_top1=1.0, max_ppl_ratio=1.0)) == 3
    assert broken_bounds(report_for(kld=math.nan), max_kld=1.0) == ["mean KLD nan > --max-kld 1"]


NUM, OPT, INT_OPT = float, (float, type(None)), (int, type(None))
GOLDEN_SCHEMA = [  # key order and value types of edgeq.fidelity/1 (docs/fidelity.md, "JSON")
    ("schema", str), ("partial", bool), ("ctx", int), ("score", str), ("windows", int), ("tokens_scored", int),
    ("ref_topk", INT_OPT),
    ("ppl_ref", NUM), ("ppl_ref_err", OPT), ("ppl_quant", NUM), ("ppl_quant_err", OPT),
    ("ppl_ratio", NUM), ("ppl_ratio_err", OPT), ("ln_ppl_ratio", NUM), ("ln_ppl_ratio_err", OPT),
    ("nll_correlation", OPT),
    ("kld_mean", NUM), ("kld_mean_err", OPT), ("kld_median", NUM), ("kld_p90", NUM), ("kld_p95", NUM),
    ("kld_p99", NUM), ("kld_p999", NUM), ("kld_max", NUM), ("kld_topk_bound", OPT), ("ref_tail_mass", OPT),
    ("top1_agreement", NUM), ("top1_agreement_err", OPT), ("top5_overlap", NUM), ("top5_overlap_err", OPT),
    ("delta_p_mean", NUM), ("delta_p_mean_err", OPT), ("delta_p_rms", NUM), ("delta_p_rms_err", OPT),
    ("per_layer", (list, type(None))), ("per_layer_count", INT_OPT),
]


def test_json_schema_golden(tmp_path):
    model, quant = TinyLM(), quantised_copy(TinyLM(), 0.1)
    text = make_text(300)
    full = json.loads(compare(side(model), side(quant), text=text, ctx=32, per_layer=True,
                                save_ref=tmp_path / "r").to_json())
    cached = json.loads(compare_to_reference_file(tmp_path / "r", side(quant)).to_json())
    for d in (full, cached):
        assert list(d) == [k for k, _ in GOLDEN_SCHEMA]
        for k, t in GOLDEN_SCHEMA:
            assert isinstance(d[k], t) and not (t is float and isinstance(d[k], bool)), (k, d[k])
    assert full["schema"] == "edgeq.fidelity/1"
    assert full["ref_topk"] is None and full["kld_topk_bound"] is None and isinstance(full["per_layer"], list)
    assert cached["ref_topk"] == 32 and isinstance(cached["kld_topk_bound"], float) and cached["per_layer"] is None
    assert [list(e) for e in full["per_layer"]] == [["name", "rel_err", "local_rel_err"]] * 3
    assert isinstance(full["nll_correlation"], float) and isinstance(full["kld_mean_err"], float)
    # non-finite values become null so that the output is strict JSON
    inf = FidelityReport(**{**compare(side(model), side(quant), text=text, ctx=32).__dict__, "kld_max": math.inf})
    assert json.loads(inf.to_json())["kld_max"] is None


def test_render_is_a_compact_table():
    from rich.console import Console

    rep = compare(side(TinyLM()), side(quantised_copy(TinyLM(), 0.1)), text=make_text(300), ctx=32,
                    per_layer=True)
    con = Console(width=100, record=True)
    con.print(render(rep, top=2))
    out = con.export_text()
    for needle in ("PPL(quant)/PPL(ref)", "mean KLD", "same top-1", "RMS Δp", "worst 2 of 3"):
        assert needle in out, needle
    worst = [e.name for e in rep.per_layer]
    assert worst[0] in out and worst[1] in out and worst[2] not in out


# ------------------------------------------------------------------------------------------------------ CLI


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]  # after the progress bar's leftovers on stderr


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    """``edgeq fidelity ARGS --text T --ctx 32``, checkpoints "ref"/"light"/"heavy"/"same" resolved by a fake loader."""
    model = TinyLM()
    models = {"ref": model, "same": copy.deepcopy(model), "light": quantised_copy(model, 0.02),
              "heavy": quantised_copy(model, 0.5)}
    monkeypatch.setattr(checkpoints, "_default_load", lambda p: side(models[Path(p).name]))
    monkeypatch.chdir(tmp_path)  # the checkpoints are local directories (else they would be looked up on the hub)
    for name in models:
        (tmp_path / name).mkdir()
    text = tmp_path / "t.txt"
    text.write_text(make_text(500))

    def run(*args) -> SimpleNamespace:
        code, out, err = run_cli(["fidelity", *args, "--text", text, "--ctx", "32"], capsys)
        return SimpleNamespace(code=code, out=out, err=err)
    return run


def test_cli_json_and_thresholds(cli):
    ok = cli("ref", "light", "--json", "--max-kld", "1", "--min-top1", "0.5", "--max-ppl-ratio", "2")
    assert ok.code == 0, ok.err
    d = json.loads(ok.out)
    assert d["schema"] == "edgeq.fidelity/1" and d["tokens_scored"] == 15 * d["windows"]
    bad = cli("ref", "heavy", "--json", "--max-kld", "1e-6", "--min-top1", "0.5")
    assert bad.code == 1  # a ThresholdError: "threshold broken: <the broken bounds>"
    broken = _last_line(bad.err)
    assert broken.startswith("threshold broken: mean KLD ") and broken.endswith("> --max-kld 1e-06")
    same = cli("ref", "same", "--max-kld", "0", "--min-top1", "1", "--max-ppl-ratio", "1")
    assert same.code == 0 and "mean KLD" in same.out


def test_cli_ref_file_flow(cli, tmp_path):
    ref = tmp_path / "ref.safetensors"
    saved = cli("ref", "--save-ref", str(ref))
    assert saved.code == 0, saved.err
    assert "positions, PPL(ref)" in saved.out and ref.is_file()
    out = cli("light", "--ref", str(ref), "--json")
    assert out.code == 0, out.err
    assert json.loads(out.out)["ref_topk"] == 32
    both = cli("ref", "light", "--ref", str(ref))  # an EdgeqError: exit 2, "error: <message>"
    assert both.code == 2 and _last_line(both.err).startswith("error: ")
    assert "--ref FILE replaces the REF checkpoint" in _last_line(both.err)
    lone = cli("light")
    assert lone.code == 2 and _last_line(lone.err).startswith("error: ") and "one checkpoint given" in lone.err


def test_cli_per_layer_table(cli):
    out = cli("ref", "heavy", "--per-layer", "--top", "2")
    assert out.code == 0, out.err
    assert "worst 2 of 3 quantised linears" in out.out


def test_cli_refuses_swapped_reference_and_quantised(cli, tmp_path, capsys):
    """REF an edgeq checkpoint, QUANT not: refused (exit 2, one line with the fix) before anything is loaded.
    Scored as given (--allow-swapped), the PPL ratio is the reciprocal of the true one: a gate would be fooled."""
    (tmp_path / "heavy" / "edgeq_manifest.json").write_text("{}")  # only the file's presence marks an edgeq checkpoint
    common = ["--text", str(tmp_path / "t.txt"), "--ctx", "32", "--json"]
    code, out, err = run_cli(["fidelity", "heavy", "ref", "--max-ppl-ratio", "1", *common], capsys)
    assert code == 2 and out == "", (out, err)
    assert err.startswith("error: fidelity: REF heavy is an edgeq checkpoint and QUANT ref is not; the order is REF "
                          "QUANT") and "run edgeq fidelity ref heavy, or pass --allow-swapped" in err
    assert err.count("\n") == 1
    code, out, err = run_cli(["fidelity", "ref", "heavy", *common], capsys)
    assert code == 0, err
    right = json.loads(out)["ppl_ratio"]
    code, out, err = run_cli(["fidelity", "heavy", "ref", "--allow-swapped", *common], capsys)
    assert code == 0, err
    assert json.loads(out)["ppl_ratio"] == pytest.approx(1 / right, rel=1e-9) and right != pytest.approx(1)


def test_order_check_takes_two_edgeq_or_two_plain_checkpoints_as_given(tmp_path):
    for name in ("a", "b", "q"):
        (tmp_path / name).mkdir()
    (tmp_path / "q" / "edgeq_manifest.json").write_text("{}")
    (tmp_path / "b" / "edgeq_manifest.json").write_text("{}")
    check_order(tmp_path / "a", tmp_path / "q")  # the right order
    check_order(tmp_path / "b", tmp_path / "q")  # two edgeq checkpoints (e.g. two schemes)
    check_order(tmp_path / "a", tmp_path / "a")  # two plain ones
    check_order(tmp_path / "q", tmp_path / "a", allow_swapped=True)
    with pytest.raises(EdgeqError, match="the order is REF QUANT"):
        check_order(tmp_path / "q", tmp_path / "a")
    with pytest.raises(EdgeqError, match="the order is REF QUANT"):  # the API refuses too, before loading anything
        run_fidelity(tmp_path / "q", tmp_path / "a", load_fn=lambda p: pytest.fail("loaded"))


# ------------------------------------------------------------------------------------------- transformers path
def test_transformers_llama_with_the_bundled_tokenizer_and_text():
    """A tiny random Llama (transformers) on the bundled tokenizer and default text; logits_to_keep is used."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(DATA / "tiny-prose")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    a = SimpleNamespace(model=model, tokenizer=tok)
    rep = compare(a, a, ctx=64, max_tokens=100)
    assert rep.tokens_scored == 100 and rep.kld_mean == 0.0 and rep.top1_agreement == 1.0
    # the same numbers from a scorer that returns all logits (no logits_to_keep)
    full = compare(lambda ids: model(input_ids=ids).logits, model, tokenizer=tok, ctx=64, max_tokens=100)
    assert full.ppl_ref == pytest.approx(rep.ppl_ref, rel=1e-5) and full.kld_mean < 1e-9
    assert tokenizer_sha256(tok) == tokenizer_sha256(AutoTokenizer.from_pretrained(
        DATA / "tiny-prose"))


# ------------------------------------------------------------------------------------------------- the runtime
def test_end_to_end_on_the_bundled_model(fixture_model, fixture_quantized, tmp_path):
    """edgeq.runtime.load on both sides: the bf16 reference against itself and against its w4a16-g128 checkpoint."""
    same = run_fidelity(fixture_model, fixture_model, ctx=128, max_tokens=63)
    assert same.kld_mean == 0.0 and same.top1_agreement == 1.0 and same.tokens_scored == 63

    ref_file = tmp_path / "ref.safetensors"
    rep = run_fidelity(fixture_model, fixture_quantized, ctx=128, max_tokens=200, per_layer=True, top=40,
                         save_ref=ref_file)
    assert rep.tokens_scored == 200 and rep.windows == 4 and not rep.partial
    # a real 4-bit model of this size: measurably different, still the same model
    assert 0.001 < rep.kld_mean < 0.1 and 0.75 < rep.top1_agreement < 1.0
    # 200 tokens: the default's (least-squares rounding, finer head) PPL ratio is 0.988 here, within sampling noise
    assert 0.95 < rep.ppl_ratio < 1.1 and rep.nll_correlation > 0.98
    names = {e.name for e in rep.per_layer}
    assert rep.per_layer_count == 29 and len(names) == 29  # 4 layers x 7 linears + the untied, quantised head
    assert "lm_head" in names and "model.layers.0.mlp.down_proj" in names
    assert all(0 < e.rel_err < 0.5 and 0 < e.local_rel_err < 0.5 for e in rep.per_layer)

    cached = run_fidelity(None, fixture_quantized, ref_file=ref_file)
    for name in ("ppl_ref", "ppl_quant", "top1_agreement", "top5_overlap", "delta_p_rms"):
        assert getattr(cached, name) == pytest.approx(getattr(rep, name), rel=1e-9), name
    assert cached.kld_mean <= rep.kld_mean <= cached.kld_mean + cached.kld_topk_bound
