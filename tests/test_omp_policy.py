"""edgeq leaves libgomp's waiting policy to the user (measured: PASSIVE cost 0.60x prefill and 0.83x decode on a
quiet machine, docs/runtime.md), every bench arm (llama.cpp's included) gets the same OpenMP environment, and a
starved pass's flag names the remedy."""

import os
import subprocess
import sys

from edgeq.bench.process import worker_env
from edgeq.bench.records import Arm


def test_importing_edgeq_leaves_the_policy_alone():
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", "import edgeq.cli.main, os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=e, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_worker_env_is_the_same_for_every_arm(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    a = worker_env(Arm("A", "x", threads=2))
    g = worker_env(Arm("G", "m.gguf", kind="gguf", threads=2))
    assert a["OMP_WAIT_POLICY"] == g["OMP_WAIT_POLICY"] == "PASSIVE"
    assert a["OMP_NUM_THREADS"] == g["OMP_NUM_THREADS"] == "2"
    b = worker_env(Arm("B", "x", threads=1, env=(("OMP_WAIT_POLICY", "ACTIVE"),)))
    assert b["OMP_WAIT_POLICY"] == "ACTIVE" and b["OMP_NUM_THREADS"] == "1"
