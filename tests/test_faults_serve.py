"""The server under bad requests and faults (issue #14): bounded fields, unsupported fields, unknown models, clients
that leave, a damaged checkpoint, internal errors. A real uvicorn on a free 127.0.0.1 port, spoken to with httpx,
http.client (to see the keep-alive connection) and the openai client."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.runtime import load
from edgeq.runtime.serve import handlers as serve_handlers
from edgeq.runtime.serve import INT64_MAX, INT64_MIN, create_app
from helpers.checkpoints import prose_checkpoint, with_chat_template
from helpers.serve import running_server

openai = pytest.importorskip("openai")
NAME = "prose-chat"
CONTEXT = 128


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    q = with_chat_template(prose_checkpoint(tmp_path_factory), tmp_path_factory.mktemp("faults") / NAME)
    lm = load(q, prefill_threshold=4, max_model_len=CONTEXT)
    app = create_app(lm, queue_size=2, max_body_bytes=8192)
    with running_server(app) as url:
        yield url, lm, app


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str)
    return err


def _wait_idle(url: str, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if httpx.get(url + "/health").json()["running"] == 0:
            return True
        time.sleep(0.02)
    return False


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("path, field, value, code", [
    (CMPL, "seed", 2**80, "invalid_value"),
    (CMPL, "seed", INT64_MIN - 1, "invalid_value"),
    (CHAT, "seed", 2**64, "invalid_value"),
    (CMPL, "max_tokens", 2**80, "invalid_value"),
    (CMPL, "max_tokens", 0, "invalid_value"),
    (CHAT, "max_completion_tokens", 2**40, "invalid_value"),
    (CHAT, "max_tokens", -3, "invalid_value"),
    (CMPL, "n", 0, "invalid_value"),
    (CHAT, "n", 2, "invalid_value"),
    (CMPL, "logprobs", 6, "invalid_value"),
    (CMPL, "logprobs", -1, "invalid_value"),
    (CHAT, "top_logprobs", 21, "invalid_value"),
    (CMPL, "temperature", 2.5, "invalid_value"),
    (CHAT, "top_p", 0, "invalid_value"),
    (CMPL, "top_p", 1.5, "invalid_value"),
    (CMPL, "seed", 1.5, "invalid_type"),
    (CMPL, "max_tokens", [4], "invalid_type"),
])
def test_every_numeric_field_is_bounded(served, path, field, value, code):
    url = served[0]
    body = {"prompt": "Once", "max_tokens": 2} if path == CMPL else {"messages": MSGS, "max_tokens": 2, "logprobs": True}
    err = _error(_post(url, path, {**body, field: value}), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and err["code"] == code
    assert err["type"] == "invalid_request_error"


def test_nan_and_infinity_are_not_json(served):
    r = httpx.post(served[0] + CMPL, content=b'{"prompt": "Once", "temperature": NaN}',
                   headers={"content-type": "application/json"})
    err = _error(r, 400)
    assert err["code"] == "invalid_json" and "NaN is not valid JSON" in err["message"]


def test_the_whole_seed_range_works_and_nulls_mean_defaults(served):
    url = served[0]
    for seed in (INT64_MIN, INT64_MAX):
        r = _post(url, CMPL, {"prompt": "Once", "max_tokens": 2, "temperature": 0.8, "seed": seed})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = _post(url, CMPL, {"prompt": "Once", "max_tokens": None, "temperature": None, "seed": None, "stop": None,
                          "n": None, "model": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens


@pytest.mark.parametrize("fields, named", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ["tools"]),
    ({"response_format": {"type": "json_object"}}, ["response_format"]),
    ({"presence_penalty": 0.5}, ["presence_penalty"]),
    ({"logit_bias": {"7": 5}}, ["logit_bias"]),
    ({"tools": [{"type": "function"}], "response_format": {"type": "json_schema"}, "frequency_penalty": 1},
     ["tools", "response_format", "frequency_penalty"]),
])
def test_unsupported_fields_are_named(served, fields, named):
    err = _error(_post(served[0], CHAT, {"messages": MSGS, "max_tokens": 2, **fields}), 400)
    assert err["code"] == "unsupported_parameter" and err["param"] == named[0]
    assert all(f"{k}=" in err["message"] for k in named) and "not supported" in err["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(served):
    r = _post(served[0], CHAT, {"messages": MSGS, "max_tokens": 2, "tools": [], "tool_choice": "none",
                                "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
                                "logit_bias": {}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    err = _error(_post(served[0], CMPL, {"prompt": "Once", "echo": True}), 400)
    assert err["param"] == "echo" and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("body, param, code, message", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]", "unsupported_value", "messages[0].content[1]: only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "invalid_type", "messages[0].content[0].text: must be a string, got 5"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_value", "messages[0].role: "),
    ({"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "invalid_value", "requires logprobs=true"),
])
def test_chat_message_checks(served, body, param, code, message):
    err = _error(_post(served[0], CHAT, body), 400)
    assert err["param"] == param and err["code"] == code and message in err["message"]


def test_unknown_model_is_404_and_models_have_an_id_route(served):
    url, lm, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message and NAME in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Once", max_tokens=2)
    assert client.completions.create(model=NAME, prompt="Once", max_tokens=2).choices[0].text is not None
    assert client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2).model == NAME
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.created == int((lm.path / "config.json").stat().st_mtime)
    assert 1_600_000_000 < card.created <= time.time()
    assert [m.id for m in client.models.list()] == [NAME]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other/model")
    assert _error(httpx.get(url + "/v1/models/other/model"), 404)["code"] == "model_not_found"


def test_chat_without_a_template_speaks_http(served, monkeypatch):
    monkeypatch.setattr(served[1].tokenizer, "chat_template", None)
    err = _error(_post(served[0], CHAT, {"messages": MSGS}), 400)
    assert err["code"] == "no_chat_template" and "/v1/completions" in err["message"] and "--" not in err["message"]


def test_a_model_without_tokenizer_is_refused_before_serving(served, monkeypatch):
    monkeypatch.setattr(served[1], "tokenizer", None)
    with pytest.raises(EdgeqError, match=r"no tokenizer files .* copy them from the source model"):
        create_app(served[1])


def _slow_decode(monkeypatch, lm, delay: float = 0.02) -> list:
    """Make each decode step take ``delay`` seconds; the returned list counts the steps."""
    steps, step = [], lm.decode_step

    def slow(token):
        steps.append(token)
        time.sleep(delay)
        return step(token)

    monkeypatch.setattr(lm, "decode_step", slow)
    return steps


def test_non_streaming_client_that_leaves_cancels_its_generation(served, monkeypatch):
    url, lm, _ = served
    steps = _slow_decode(monkeypatch, lm)  # 100 tokens take over 2 s
    body = {"prompt": "Once", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        _post(url, CMPL, body, timeout=0.5)
    assert _wait_idle(url, 1.0), "the generation kept running after its client left"
    assert len(steps) < 99
    # the generation finished with the step that noticed: the next request is served in full
    r = _post(url, CMPL, {**body, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_a_waiting_client_that_leaves_costs_no_prefill(served, monkeypatch):
    url, lm, app = served
    prefills, forward = [], lm.forward
    monkeypatch.setattr(lm, "forward", lambda *a, **k: prefills.append(1) or forward(*a, **k))
    release = threading.Event()
    app.state.engine.submit(release.wait)  # a generation in progress, held until released
    try:
        with pytest.raises(httpx.ReadTimeout):
            _post(url, CMPL, {"prompt": "Once", "max_tokens": 4}, timeout=0.5)
        time.sleep(0.5)  # the server notices the closed connection before the worker is free
    finally:
        release.set()
    assert _wait_idle(url, 5.0) and httpx.get(url + "/health").json()["waiting"] == 0
    assert prefills == []


def _raise(exc: Exception):
    def fail(*_a, **_k):
        raise exc
    return fail


DAMAGED = "model.layers.0.mlp.down_proj: non-finite logits (the checkpoint is damaged); re-quantize it"


@pytest.mark.parametrize("stream", [False, True])
def test_damaged_checkpoint_at_prefill_is_a_500(served, monkeypatch, stream):
    url, lm, _ = served
    monkeypatch.setattr(lm, "forward", _raise(DamagedCheckpointError(DAMAGED)))
    err = _error(_post(url, CHAT, {"messages": MSGS, "max_tokens": 4, "stream": stream}), 500)
    assert err == {"message": DAMAGED, "type": "server_error", "param": None, "code": "damaged_checkpoint"}
    assert _wait_idle(url, 5.0) and httpx.get(url + "/health").json()["status"] == "ok"


def test_damaged_checkpoint_mid_stream_is_an_error_event(served, monkeypatch):
    url, lm, _ = served
    monkeypatch.setattr(lm, "decode_step", _raise(DamagedCheckpointError(DAMAGED)))
    with httpx.stream("POST", url + CMPL, json={"prompt": "Once", "max_tokens": 8, "stream": True,
                                                       "ignore_eos": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == {"message": DAMAGED, "type": "server_error", "param": None,
                                               "code": "damaged_checkpoint"}


def test_non_finite_logits_of_the_served_model_are_a_500_damaged_checkpoint(served):
    """The real generator's check (no monkeypatched generator): ``model.norm`` made to output Inf, as a damaged
    weight would, so the prefill's logits are not finite."""
    url, lm, _ = served
    norm = dict(lm.model.named_modules())["model.norm"]
    handle = norm.register_forward_hook(lambda _m, _i, out: out * float("inf"))
    try:
        for stream in (False, True):
            err = _error(_post(url, CHAT, {"messages": MSGS, "max_tokens": 4, "stream": stream}), 500)
            assert err["code"] == "damaged_checkpoint" and err["type"] == "server_error"
            assert "not finite" in err["message"] and "model.norm" in err["message"]
    finally:
        handle.remove()
    assert _post(url, CHAT, {"messages": MSGS, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("where", ["generation", "handler"])
def test_internal_error_is_a_json_500_on_a_live_connection(served, monkeypatch, where):
    url, lm, _ = served
    if where == "generation":
        monkeypatch.setattr(lm, "forward", _raise(RuntimeError("boom")))
    else:
        monkeypatch.setattr(serve_handlers, "encode_prompt", _raise(RuntimeError("boom")))
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    try:
        conn.request("POST", CMPL, json.dumps({"prompt": "Once", "max_tokens": 2}),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 500 and err["code"] == "internal_error" and "RuntimeError: boom" in err["message"]
        sock = conn.sock
        conn.request("GET", "/health")  # the same keep-alive connection still answers
        assert conn.sock is sock and conn.getresponse().status == 200
    finally:
        conn.close()


# ------------------------------------------------------------------------- bodies the parser or tokenizer cannot take

@pytest.mark.parametrize("body, message", [
    (b"[" * 5000, "nested too deeply"),
    (b'{"prompt": "hi", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested too deeply"),
    (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate (\\ud800)"),
    (b'{"prompt": ["a\\udc80"]}', "lone UTF-16 surrogate (\\udc80)"),
    (b'{"model": "\\ud800", "prompt": "hi"}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udc80"}]}', "lone UTF-16 surrogate"),
], ids=["deep-array", "deep-field", "surrogate-prompt", "surrogate-list", "surrogate-model", "surrogate-chat"])
def test_json_no_reply_could_be_made_of_is_a_400(served, body, message):
    url = served[0]
    path = CHAT if b"messages" in body else CMPL
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    err = _error(r, 400)
    assert err["code"] == "invalid_json" and message in err["message"], err
    assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("path, field, value", [
    (CMPL, "max_tokens", "5"), (CMPL, "max_tokens", True), (CMPL, "max_tokens", 5.0), (CMPL, "stream", "yes"),
    (CMPL, "temperature", "0.5"), (CMPL, "logprobs", True), (CHAT, "logprobs", 1), (CHAT, "max_tokens", "3"),
    (CMPL, "prompt", [True, False]), (CMPL, "prompt", 5), (CMPL, "prompt", {"text": "hi"}), (CMPL, "prompt", [1, "a"]),
])
def test_a_value_of_the_wrong_json_type_is_refused_not_converted(served, path, field, value):
    body = {"prompt": "Once"} if path == CMPL else {"messages": MSGS}
    err = _error(_post(served[0], path, {**body, "max_tokens": 2, field: value}), 400)
    assert err["param"] == field and err["code"] == "invalid_type" and err["message"].startswith(f"{field}: "), err


def test_integers_are_numbers(served):
    r = _post(served[0], CMPL, {"prompt": "Once", "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_prompt_forms_openai_allows(served):
    url, lm, _ = served
    ids = lm.tokenizer("Once upon")["input_ids"]
    body = {"max_tokens": 4, "temperature": 0}
    texts = [_post(url, CMPL, {**body, "prompt": p}).json()["choices"][0]["text"]
             for p in ("Once upon", ["Once upon"], ids, [ids])]
    assert len(set(texts)) == 1 and texts[0]
    err = _error(_post(url, CMPL, {**body, "prompt": [ids, ids]}), 400)
    assert "batching is not supported" in err["message"] and err["param"] == "prompt"
    err = _error(_post(url, CMPL, {**body, "prompt": ""}), 400)
    assert err["param"] == "prompt" and err["message"] == "prompt: empty (0 tokens); send at least one token"


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-300},
                                   {"top_p": 1e-45, "temperature": 2}])
def test_sampling_values_at_the_edge_of_their_range_are_the_greedy_limit(served, extra):
    url = served[0]
    body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "seed": 1}
    greedy = _post(url, CMPL, {**body, "temperature": 0}).json()["choices"][0]["text"]
    for stream in (False, True):
        r = _post(url, CMPL, {**body, **extra, "stream": stream})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
            if line.startswith("data: {"))
        assert text == greedy


def test_health_answers_head(served):
    r = httpx.head(served[0] + "/health")
    assert r.status_code == 200 and r.content == b""


# ------------------------------------------------------------------------------------------------------- stopping

def test_a_stopping_engine_ends_the_running_generation_and_the_queue_with_503(served, monkeypatch):
    """What the server's first SIGTERM or Ctrl-C does (command._StoppingServer): the running generation stops at its
    next token, the waiting one never starts, both are answered 503, and so is a request that arrives after."""
    _, lm, _ = served
    steps = _slow_decode(monkeypatch, lm)  # 100 tokens take over 2 s
    app = create_app(lm, queue_size=2)
    body = {"prompt": "Once", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    answers: dict[str, httpx.Response] = {}
    with running_server(app) as url:
        def post(key, stream):
            answers[key] = _post(url, CMPL, {**body, "stream": stream})
        threads = [threading.Thread(target=post, args=("running", False)),
                   threading.Thread(target=post, args=("streaming", True))]
        threads[0].start()
        assert _wait_for(lambda: httpx.get(url + "/health").json()["running"] == 1)
        threads[1].start()
        assert _wait_for(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
        app.state.engine.stop()
        for t in threads:
            t.join(10)
        after = _post(url, CMPL, body)
    assert len(steps) < 99, "the running generation went on after the stop"
    err = _error(answers["running"], 503)
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
    assert _error(answers["streaming"], 503)["code"] == "server_shutting_down"  # it never started: a plain 503
    assert _error(after, 503)["code"] == "server_shutting_down"


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
