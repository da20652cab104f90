"""The model card README.md: written by every quantize, filled by ``edgeq fidelity --save-card`` (edgeq/convert/card.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from edgeq.convert import card
from edgeq.convert.plan import effective_bits
from edgeq.convert.pipeline import convert, prepare
from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest
from edgeq.scheme import Scheme
from helpers.cli import run_cli
from helpers.models import save_tiny


@pytest.fixture
def quant(fixture_quantized, tmp_path) -> Path:
    """A private copy of the bundled model's w4a16-g128 checkpoint (its card is rewritten by the tests)."""
    out = tmp_path / "quant"
    shutil.copytree(fixture_quantized, out)
    return out


def test_card_bits_count_each_module_at_its_own_group_size(quant):
    """The bundled model's default recipe puts the first layer, the head, q/k/v and down_proj at g32 and the rest at
    the scheme's g128: the card's figure is inspect's (every stored byte over every weight), not g128's 4.25."""
    from edgeq.inspect.report import inspect_checkpoint

    manifest = json.loads((quant / "edgeq_manifest.json").read_text())
    assert set(manifest["group_sizes"].values()) == {32}
    bits = card.bits_per_weight(Manifest.from_json(manifest))
    assert bits == pytest.approx(inspect_checkpoint(quant).effective_bits, rel=1e-12)
    assert 4.5 < bits < 5  # between all-g128 (4.25) and all-g32 (5.0)
    mask = os.umask(0)
    os.umask(mask)
    assert (quant / "README.md").stat().st_mode & 0o777 == 0o666 & ~mask  # as config.json, not mkstemp's 0600


@pytest.mark.parametrize("scheme", ["w4a16-g32", "w4a8-g32"])
def test_card_states_what_was_written(tmp_path, scheme):
    src = save_tiny("qwen2", tmp_path / "src")
    out = tmp_path / "out"
    convert(src, out, scheme=Scheme.parse(scheme))
    text = (out / "README.md").read_text()
    manifest = json.loads((out / "edgeq_manifest.json").read_text())
    plan = prepare(src, Scheme.parse(scheme), None, None)[1]
    bits = card.bits_per_weight(Manifest.from_json(manifest))
    assert bits == pytest.approx(effective_bits(plan), rel=1e-12)  # the card's figure is the plan's
    assert f"| bits per weight | {bits:.3f} (scales and zeros included) |" in text
    assert f"| made from | `{src}` (qwen2) |" in text
    assert f"| scheme | `{scheme}`:" in text and "| method | `rtn` |" in text
    assert "| output head | quantised (from `lm_head.weight`) |" in text
    assert manifest["layout"]["layout_hash"][:12] in text
    assert ("any x86-64 CPU, unchanged" in text) == scheme.startswith("w4a8")
    assert "Not measured yet. `edgeq fidelity REF out/ --save-card`" in text
    for how in ('import edgeq  # required', 'AutoModelForCausalLM.from_pretrained("out/")', "edgeq generate out/",
                'pip install "edgeq[vllm]"', "python -m vllm.entrypoints.openai.api_server --model out/ --dtype bfloat16", "Without `import edgeq`"):
        assert how in text, how
    assert text.startswith("---\nlibrary_name: edgeq\n") and "base_model:" not in text  # a local source


def test_hub_cache_source_is_named_by_its_id(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    assert card.source_name(snap) == "Qwen/Qwen2.5-0.5B"
    assert card.source_name(tmp_path / "plain") == str(tmp_path / "plain")


def test_fidelity_save_card_writes_the_measured_figures(fixture_model, quant, capsys):
    before = (quant / "README.md").read_text()
    args = ["fidelity", str(fixture_model), str(quant), "--ctx", "64", "--max-tokens", "96", "--json", "--save-card"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads(out)
    text = (quant / "README.md").read_text()
    assert f"| mean KLD (nats, +- 1 s.e.) | {report['kld_mean']:.5f} +- {report['kld_mean_err']:.5f} |" in text
    assert f"| same top-1 token | {100 * report['top1_agreement']:.1f}% |" in text
    assert f"{report['tokens_scored']:,} tokens scored" in text and f"`{fixture_model}`" in text
    assert "Not measured yet" not in text and text.count(card.FIDELITY_START) == 1
    head, tail = before.split(card.FIDELITY_START)[0], before.split(card.FIDELITY_END)[1]
    assert text.startswith(head) and text.endswith(tail)  # only the fidelity section changed
    assert "wrote the fidelity figures into" in err
    code, _, err = run_cli(args, capsys)  # a second measurement replaces the first
    assert code == 0, err
    assert (quant / "README.md").read_text().count(card.FIDELITY_START) == 1
    assert not [p for p in quant.iterdir() if p.name.startswith(".README.md.")]  # no temporary left


def test_save_card_refuses_a_plain_checkpoint_before_running(fixture_model, quant, capsys):
    code, out, err = run_cli(["fidelity", str(quant), str(fixture_model), "--allow-swapped", "--save-card"], capsys)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and "no edgeq_manifest.json; --save-card writes into an edgeq checkpoint" in err
    assert not (fixture_model / "README.md").exists()


def test_card_edited_by_hand_keeps_its_text(quant):
    (quant / "README.md").write_text("# my notes\n\nkept as written\n")
    record = {"kld_mean": 0.01, "kld_mean_err": 0.001, "kld_p99": 0.05, "kld_max": 0.1, "top1_agreement": 0.9,
              "top5_overlap": 0.95, "ppl_ratio": 1.01, "tokens_scored": 100, "windows": 2, "ctx": 64, "score": "half",
              "reference": "ref/", "text": "t.txt", "date": "2026-12-01", "edgeq": "0.1.0"}
    card.save_fidelity(quant, record)
    text = (quant / "README.md").read_text()
    assert text.startswith("# my notes\n\nkept as written\n\n" + card.FIDELITY_START) and "| mean KLD" in text
    (quant / "README.md").unlink()  # a checkpoint without a card gets a whole one, figures included
    card.save_fidelity(quant, record)
    text = (quant / "README.md").read_text()
    assert "| made from | not recorded" in text and "| mean KLD (nats, +- 1 s.e.) | 0.01000 +- 0.00100 |" in text


def test_a_failed_write_leaves_the_card_as_it_was(quant, monkeypatch):
    before = (quant / "README.md").read_bytes()

    def fail(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        card.write_card(quant)
    assert (quant / "README.md").read_bytes() == before
    assert sorted(p.name for p in quant.iterdir() if p.name.startswith(".")) == []


def test_card_of_a_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(EdgeqError, match="config.json: missing; a model card describes an edgeq checkpoint"):
        card.write_card(tmp_path)
