"""edgeq defaults libgomp to PASSIVE waiting (edgeq/__init__.py), unless the user chose or torch was loaded first;
the llama.cpp bench arm keeps the user's own policy."""

import os
import subprocess
import sys

import edgeq
from edgeq.bench import Arm, worker_env

PROBE = "import {first}; import os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _run(first: str, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EDGEQ_KEEP_OMP_ENV")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=e, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_importing_edgeq_first_sets_passive():
    assert _run("edgeq") == "PASSIVE"


def test_user_choice_wins():
    assert _run("edgeq", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_torch_loaded_first_is_left_alone():
    # libgomp has read the environment already: setting it now would claim a policy that is not in effect
    assert _run("torch, edgeq") == "None"


def test_keep_env_leaves_it_unset():
    assert _run("edgeq", EDGEQ_KEEP_OMP_ENV="1") == "None"


def test_worker_env_per_arm(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(edgeq, "OMP_WAIT_POLICY_USER", None)
    e = worker_env(Arm("A", "x", threads=2))
    assert e["OMP_WAIT_POLICY"] == "PASSIVE" and e["OMP_NUM_THREADS"] == "2"
    g = worker_env(Arm("G", "m.gguf", kind="gguf", threads=2))
    assert "OMP_WAIT_POLICY" not in g and g["EDGEQ_KEEP_OMP_ENV"] == "1"
    monkeypatch.setattr(edgeq, "OMP_WAIT_POLICY_USER", "ACTIVE")
    assert worker_env(Arm("G", "m.gguf", kind="gguf", threads=2))["OMP_WAIT_POLICY"] == "ACTIVE"
