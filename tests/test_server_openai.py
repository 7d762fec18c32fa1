"""`arbor serve`'s OpenAI surface and access control, over real HTTP on 127.0.0.1: usage in streams,
model cards, text content parts, a 400 for every parameter it does not implement, bearer-token auth,
weight updates off by default, and the CLI's safe defaults."""

import httpx
import pytest
import torch

from arbor.cli import build_parser
from arbor.engine import EngineConfig
from arbor.serve.server import build_app
from arbor.serve.config import ServerConfig
from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
from tests.server_helpers import running, sse_events, tiny_folder

COMPLETION = {"model": "tiny", "prompt": "Hi there", "max_tokens": 6, "temperature": 0, "n": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def client(folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ThreadedAsyncLLMEngine(str(folder), EngineConfig(max_model_len=128))
    with running(build_app(engine, "tiny")) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c
    torch.set_num_threads(threads)


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_options_include_usage(client, path, body):
    whole = client.post(path, json=body).json()
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(client.post(path, json={**body, **usage}).text)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-1])
    plain = sse_events(client.post(path, json={**body, "stream": True}).text)
    assert all("usage" not in e for e in plain)


def test_model_card_by_id(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json() == client.get("/v1/models").json()["data"][0]
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_text_content_parts_equal_a_string(client):
    parts = [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]
    as_parts = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]})
    as_text = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "2+2\n?"}]})
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["token_ids"] == as_text.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"logit_bias": {"5": 10}}), ("/v1/completions", {"echo": True}),
    ("/v1/completions", {"best_of": 3}), ("/v1/completions", {"suffix": "end"}),
    ("/v1/completions", {"presence_penalty": 0.5}), ("/v1/completions", {"frequency_penalty": 1}),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}), ("/v1/chat/completions", {"function_call": "auto"}),
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"some_new_knob": 1}),
])
def test_unimplemented_parameters_get_400(client, path, extra):
    body = COMPLETION if "chat" not in path else CHAT
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == next(iter(extra)) and err["code"] == "unsupported_parameter"


def test_no_op_values_of_unimplemented_parameters_are_accepted(client):
    r = client.post("/v1/completions", json={**COMPLETION, "echo": False, "logit_bias": {}, "best_of": 2,
                                             "presence_penalty": 0, "user": "me", "suffix": None})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": [], "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra", [{"stream": "no"}, {"stream": 1}, {"stream_options": {"include_usage": True}},
                                   {"stream": True, "stream_options": {"include_usage": "yes"}},
                                   {"stream": True, "stream_options": {"other": 1}}])
def test_stream_flags_are_checked(client, extra):
    r = client.post("/v1/completions", json={**COMPLETION, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("stream", "stream_options"), r.text


def test_api_key_guards_every_route(folder):
    engine = ThreadedAsyncLLMEngine(str(folder), EngineConfig(max_model_len=128))
    with running(build_app(engine, "tiny", ServerConfig(api_key="s3cret"))) as url:
        for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("GET", "/v1/models/tiny", None), ("POST", "/v1/completions", COMPLETION),
                                   ("POST", "/v1/chat/completions", CHAT), ("POST", "/update_weights", {"path": "x"}),
                                   ("GET", "/docs", None), ("GET", "/openapi.json", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, url + path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.get(url + "/health", headers=good).status_code == 200
        r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=good, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = httpx.post(url + "/update_weights", json={"path": str(folder)}, headers=good)
        assert r.status_code == 403 and r.json()["error"]["code"] == "weight_updates_disabled"


def test_cli_binds_localhost_and_reads_the_key_from_the_environment(monkeypatch, tmp_path):
    from arbor.serve.config import load_serve_config
    monkeypatch.delenv("ARBOR_API_KEY", raising=False)
    cfg = load_serve_config(str(tmp_path))
    assert cfg.host == "127.0.0.1" and cfg.server.api_key is None and not cfg.server.enable_weight_updates
    monkeypatch.setenv("ARBOR_API_KEY", "from-env")
    assert load_serve_config(str(tmp_path)).server.api_key == "from-env"
    assert load_serve_config(str(tmp_path), None, ['server.api_key="given"']).server.api_key == "given"
    a = build_parser().parse_args(["serve", str(tmp_path), "--api-key", "flag"])
    assert a.api_key == "flag"


def test_server_config_is_checked():
    for bad in [dict(max_n=0), dict(max_body_bytes=-1), dict(api_key=""), dict(enable_weight_updates=True),
                dict(enable_weight_updates=True, weight_updates_root="/no/such/folder"), dict(shutdown_grace_s=-1)]:
        with pytest.raises(ValueError):
            ServerConfig(**bad)
