"""The OpenAI-compatible server over real HTTP (uvicorn in a thread, httpx client)."""

import httpx
import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.serve.server import build_app
from arbor.serve.config import ServerConfig
from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
from arbor.models import CausalLM, ModelConfig, load_model, save_model
from tests.float64_ref import assert_within_engine_noise, exact_logprobs
from tests.server_helpers import running, sse_events as _events, tiny_folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tiny_folder(tmp_path_factory.mktemp("served"))
    engine = ThreadedAsyncLLMEngine(str(folder), EngineConfig(max_model_len=128))
    cfg = ServerConfig(enable_weight_updates=True, weight_updates_root=str(tmp_path_factory.getbasetemp()))
    with running(build_app(engine, "tiny", cfg)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, folder, engine.tokenizer
    torch.set_num_threads(threads)


def sse_events(resp):
    return _events(resp.text)


def test_health_and_models(server):
    client, _, _ = server
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_completion_matches_the_engine(server):
    client, folder, tok = server
    body = {"model": "tiny", "prompt": "Hi there", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = LLMEngine(str(folder)).generate(["Hi there"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
    exact = exact_logprobs(load_model(folder, dtype=torch.float64), ref.prompt_token_ids, ref.token_ids)
    assert_within_engine_noise([choice["logprobs"]["token_logprobs"]], [ref.logprobs], [exact])  # vs float64
    assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    ids = client.post("/v1/completions", json={**body, "prompt": tok.encode("Hi there")}).json()
    assert ids["choices"][0]["token_ids"] == ref.token_ids


def test_streaming_completion_and_chat(server):
    client, _, _ = server
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == full["text"]
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == full["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 5, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=chat).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    events = sse_events(client.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]


@pytest.mark.parametrize("body, param", [
    ({"model": "other", "prompt": "x"}, "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": "tiny", "prompt": [1, 2, 999]}, "prompt"),
    ({"model": "tiny", "prompt": "x" * 200}, "prompt"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "tiny"}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, param):
    client, _, _ = server
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_json_and_bad_chat(server):
    client, _, _ = server
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert client.get("/health").status_code == 200


def test_update_weights_from_a_folder(server, tmp_path):
    client, folder, tok = server
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0}
    before = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    torch.manual_seed(3)
    new = CausalLM(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                               eos_token_id=tok.eos_token_id)).eval()
    save_model(new, tmp_path / "new", tokenizer=tok)
    r = client.post("/update_weights", json={"path": str(tmp_path / "new")})
    assert r.status_code == 200 and r.json()["seconds"] >= 0
    after = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    ref = LLMEngine(str(tmp_path / "new")).generate(["Hello"], SamplingParams(temperature=0, max_tokens=6))[0]
    assert after == ref.token_ids
    assert client.post("/update_weights", json={"path": str(tmp_path / "missing")}).status_code == 400
    client.post("/update_weights", json={"path": str(folder)})
    assert client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before
