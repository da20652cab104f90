"""The OpenAI-compatible server, started for real (uvicorn on a free loopback port) and spoken to over HTTP with
httpx and the openai client."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from edgeq.runtime import SamplingParams, generate, load
from edgeq.runtime.serve import create_app
from helpers.checkpoints import prose_checkpoint, with_chat_template
from helpers.serve import running_server

openai = pytest.importorskip("openai")
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    q = with_chat_template(prose_checkpoint(tmp_path_factory), tmp_path_factory.mktemp("serve") / "prose-chat")
    lm = load(q, prefill_threshold=4, max_model_len=MAX_MODEL_LEN)
    app = create_app(lm, queue_size=8, max_body_bytes=4096)
    with running_server(app) as url:
        yield url, lm, app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_health_and_models(server):
    url, lm, _ = server
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["running"] == 0 and h["max_model_len"] == MAX_MODEL_LEN
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["prose-chat"]


def test_completion_matches_the_library_and_streams_the_same(server, client):
    _, lm, _ = server
    want = generate(lm, "Once upon a time", SamplingParams(max_tokens=12))
    r = client.completions.create(model="prose-chat", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    eos = want.eos_token is not None  # an EOS is generated, though it adds no text
    assert r.usage.completion_tokens == len(want.token_ids) + eos and r.usage.prompt_tokens == want.prompt_tokens
    chunks = list(client.completions.create(model="prose-chat", prompt="Once upon a time", max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_logprobs_seed_and_stop(server, client):
    msgs = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(model="prose-chat", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text
    lps = r.choices[0].logprobs.content
    # the EOS that may have ended it counts in usage, with no logprobs entry (it adds no text)
    assert len(lps) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop") and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)
    streamed = client.chat.completions.create(model="prose-chat", messages=msgs, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    a, b = (client.chat.completions.create(model="prose-chat", messages=msgs, max_tokens=10, temperature=0.9, seed=7)
            .choices[0].message.content for _ in range(2))
    assert a == b
    cut = client.chat.completions.create(model="prose-chat", messages=msgs, max_tokens=10, temperature=0, stop=[text[3:6]])
    assert cut.choices[0].message.content == text[: text.find(text[3:6])] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, code, message", [
    (b"{not json", 400, "invalid_json", "malformed JSON"),
    (b"[1, 2]", 400, "invalid_json", "must be an object"),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "invalid_type", "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), 400, "invalid_value", "n"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "invalid_value", "temperature"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "missing_required_parameter", "prompt"),
    (json.dumps({"prompt": "x" * 5000}).encode(), 413, "request_too_large", "at most 4096"),
    (json.dumps({"prompt": list(range(3, 3 + MAX_MODEL_LEN))}).encode(), 400, "context_length_exceeded", "context holds 256"),
    (json.dumps({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}).encode(), 400, "context_length_exceeded", "needs"),
], ids=["malformed", "not-object", "bad-type", "n", "temperature", "no-prompt", "oversized", "too-long", "too-many-tokens"])
def test_bad_requests_get_json_errors_and_the_server_lives(server, body, status, code, message):
    url = server[0]
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == code and "--" not in err["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_chat_errors_and_unknown_route(server):
    url = server[0]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def _poll(url, key, want, seconds=30):
    deadline = time.time() + seconds
    while httpx.get(url + "/health").json()[key] != want and time.time() < deadline:
        time.sleep(0.02)
    return httpx.get(url + "/health").json()[key]


@contextlib.contextmanager
def _one_running(url, app):
    """queue_size 1 behind a generation held until the block ends; yields a thread that, started, sends a request
    (its response in ``answers["r"]``) and the answers dict."""
    engine = app.state.engine
    engine.queue_size = 1
    release = threading.Event()
    engine.submit(release.wait)  # a generation in progress, held until released
    answers = {}
    t = threading.Thread(target=lambda: answers.update(r=httpx.post(url + "/v1/completions", timeout=60,
                                                                      json={"prompt": "Once", "max_tokens": 4})))
    try:
        yield t, answers
    finally:
        release.set()
        if t.ident:
            t.join(60)
        engine.queue_size = 8


def test_queue_full_gets_429(server):
    url, _, app = server
    with _one_running(url, app) as (t, waiting):
        t.start()
        assert _poll(url, "waiting", 1) == 1
        full = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        assert full.status_code == 429 and "busy" in full.json()["error"]["message"]
        streaming = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4, "stream": True})
        assert streaming.status_code == 429
    assert waiting["r"].status_code == 200 and waiting["r"].json()["choices"][0]["text"]


def test_a_waiting_client_that_leaves_frees_its_place_at_once(server):
    """A client that gives up while queued is taken out of the queue when it leaves, not when its turn comes: it stops
    counting as waiting and its place goes to the next request (queue_size 1: without this, a 429)."""
    url, _, app = server
    engine = app.state.engine
    with _one_running(url, app) as (t, later):
        with pytest.raises(httpx.ReadTimeout):  # waits behind the held one, gives up after 1 s and closes
            httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=httpx.Timeout(1.0))
        assert _poll(url, "waiting", 0) == 0 and engine.pending == 1
        t.start()
        assert _poll(url, "waiting", 1) == 1
    assert later["r"].status_code == 200 and later["r"].json()["choices"][0]["text"]
    assert _poll(url, "running", 0) == 0 and engine.pending == 0


def test_concurrent_clients_each_get_their_own_answer(server):
    url, lm, _ = server
    prompts = ["Once upon a time", "The cat", "In the morning", "She said"]
    want = {p: generate(lm, p, SamplingParams(max_tokens=8)).text for p in prompts}
    got = {}

    def ask(p):
        r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}, timeout=120)
        got[p] = (r.status_code, r.json()["choices"][0]["text"])

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {p: (200, want[p]) for p in prompts}


def test_stream_disconnect_frees_the_server(server):
    url, _, _ = server
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Once", "max_tokens": 200, "ignore_eos": True,
                                                             "temperature": 0, "stream": True}, timeout=60) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.time() + 30
    while httpx.get(url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_serve_loads_the_model_on_the_thread_that_generates(monkeypatch):
    """Torch work from a second OS thread gives it its own OpenMP team, which slowed decode by a third (docs/vllm.md):
    serve_command loads on the engine's one worker thread, and the engine generates on that same thread."""
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    import uvicorn

    import edgeq.runtime.loader as loader
    from edgeq.runtime.serve import command

    seen = {}

    def fake_load(path, **kw):
        seen["load"] = threading.current_thread()
        return SimpleNamespace(path=Path(path))

    def fake_app(lm, *, pool, **kw):
        seen["generate"] = pool.submit(threading.current_thread).result()
        return SimpleNamespace(state=SimpleNamespace(engine=None))

    monkeypatch.setattr(loader, "load", fake_load)
    monkeypatch.setattr(command, "create_app", fake_app)
    monkeypatch.setattr(command, "startup_record", lambda lm, host, port, name: {"port": port})
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    command.serve_command("ckpt", port=0)
    assert seen["load"] is seen["generate"] and seen["load"] is not threading.main_thread()


def test_the_served_id_is_never_empty(tmp_path, monkeypatch):
    """`edgeq serve .` served the id "" (Path(".").name): the id is the resolved directory's name."""
    from pathlib import Path
    from types import SimpleNamespace

    from edgeq.runtime.serve.app import served_name

    (tmp_path / "my-ckpt").mkdir()
    monkeypatch.chdir(tmp_path / "my-ckpt")
    assert served_name(SimpleNamespace(path=Path(".")), None) == "my-ckpt"
    assert served_name(SimpleNamespace(path=Path("./")), "") == "my-ckpt"
    assert served_name(SimpleNamespace(path=Path(".")), "chosen") == "chosen"
