"""`arbor serve` on a block-diffusion model, over real HTTP: each mode returns the tokens of
`arbor generate --diffusion` (``generate_text``) in that mode, a stream sends one chunk per committed
block, bad or meaningless fields get a 400, the queue is bounded and a client that leaves frees its
slot; and the `arbor serve` command itself picks the diffusion server for a block-diffusion folder."""

import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from arbor.dllm.decoding import MODES, diffusion_generate, generate_text, mode_config
from arbor.dllm.server import GEN_LENGTH, _Aborted, build_diffusion_app
from arbor.serve.config import ServerConfig
from arbor.models import load_model, save_model
from arbor.models.tokenizer import Tokenizer, builtin_tokenizer
from arbor.dllm.sft import DiffusionModelConfig, build_model
from tests.server_helpers import free_port, running, sse_events, wait_until
from tests.test_server_shutdown import wait_ready

TINY = DiffusionModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, block_size=4)
PROMPTS = ["add:12+34=", "hello"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("dllm")
    tok = builtin_tokenizer()
    model = build_model(tok, TINY, seed=1)
    with torch.no_grad():                       # spread the confidences, so that the modes decode differently
        for p in model.parameters():
            p.normal_(0, 1.0)
    save_model(model, out, tokenizer=tok)
    return out


@pytest.fixture(scope="module")
def server(folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_model(folder).eval(), Tokenizer.load(folder)
    app = build_diffusion_app(model, tok, "tiny", ServerConfig(diffusion_mode="speed", max_queued_requests=1))
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, model, tok, app.state.worker
    torch.set_num_threads(threads)


def direct(model, tok, prompts, mode, gen_length=12):
    """What `arbor generate --diffusion --mode MODE --gen-length N` decodes (its generate_text call)."""
    return [r for _, r in generate_text(model, tok, prompts, mode_config(mode, gen_length=gen_length))]


def test_each_mode_returns_the_tokens_of_arbor_generate(server):
    client, model, tok, _ = server
    seen = set()
    for mode in MODES:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS, "max_tokens": 12, "mode": mode})
        assert r.status_code == 200, r.text
        want = direct(model, tok, PROMPTS, mode)
        got = r.json()["choices"]
        assert [c["token_ids"] for c in got] == [w.tokens[:w.num_tokens] for w in want]
        assert [c["text"] for c in got] == [tok.decode(w.tokens[:w.num_tokens]) for w in want]
        assert [c["finish_reason"] for c in got] == ["length", "length"]
        seen.add(tuple(tuple(c["token_ids"]) for c in got))
    assert len(seen) == len(MODES)              # the modes are really different decoders here


def test_default_mode_and_length_come_from_the_server(server):
    client, model, tok, _ = server
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0]}).json()
    want = direct(model, tok, PROMPTS[:1], "speed", GEN_LENGTH)[0]
    assert r["choices"][0]["token_ids"] == want.tokens[:want.num_tokens]
    assert r["usage"] == {"prompt_tokens": len(tok.encode(PROMPTS[0])), "completion_tokens": want.num_tokens,
                          "total_tokens": len(tok.encode(PROMPTS[0])) + want.num_tokens}


def test_chat_and_sampling_match_the_decoder(server):
    client, model, tok, _ = server
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "mode": "quality"}).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = direct(model, tok, [text], "quality", 8)[0]
    assert r["choices"][0]["token_ids"] == want.tokens[:want.num_tokens]
    assert r["choices"][0]["message"] == {"role": "assistant", "content": tok.decode(want.tokens[:want.num_tokens])}
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "mode": "threshold", "n": 2, "temperature": 3.0, "seed": 7}
    got = [c["token_ids"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    ids = tok.encode(PROMPTS[1])
    want = diffusion_generate(model, [ids, ids], mode_config("threshold", gen_length=8, temperature=3.0, seed=7),
                              model.config.stop_token_ids)
    assert got == [w.tokens[:w.num_tokens] for w in want] and got[0] != got[1]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_sends_one_chunk_per_block(server, chat):
    client, model, tok, _ = server
    B, stop = TINY.block_size, 21               # a token the quality decode of PROMPTS[0] reaches mid-way
    ids = tok.encode(PROMPTS[0])
    body = {"max_tokens": 16, "mode": "quality", "stream": True, "stop_token_ids": [stop],
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": PROMPTS[0]}]} if chat else {"prompt": ids})
    if chat:
        ids = tok.encode(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False))
    want = diffusion_generate(model, [ids], mode_config("quality", gen_length=16), [tok.eos_token_id, stop])[0]
    assert 4 < want.num_tokens < 16             # several blocks, then the stop token
    events = sse_events(client.post("/v1/chat/completions" if chat else "/v1/completions", json=body).text)
    chunks, usage = events[:-1], events[-1]
    tokens = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert tokens == want.tokens[:want.num_tokens]
    last = len(ids) + min(want.num_tokens, 15)  # the position whose block ends the decode
    assert len(chunks) == last // B - len(ids) // B + 1
    for k, e in enumerate(chunks):              # chunk k = the response positions of block len(ids)//B + k
        b = len(ids) // B + k
        span = min((b + 1) * B, len(ids) + want.num_tokens) - max(b * B, len(ids))
        assert len(e["choices"][0]["token_ids"]) == span
        assert e["choices"][0]["finish_reason"] == (None if k < len(chunks) - 1 else
                                                    "stop" if want.num_tokens < 16 else "length")
    text = "".join(e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"] for e in chunks)
    assert text == tok.decode(want.tokens[:want.num_tokens])
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == want.num_tokens


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "mode": "fast"}, "mode", "'mode' must be one of 'quality', 'speed', 'threshold'"),
    ({"prompt": "hi", "mode": 3}, "mode", "got 3"),
    ({"prompt": "hi", "logprobs": 1}, "logprobs", "no token log-likelihood"),
    ({"prompt": "hi", "top_p": 0.5}, "top_p", "not supported for a block-diffusion model"),
    ({"prompt": "hi", "stop": "x"}, "stop", "stop_token_ids"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "must be of type float"),
    ({"prompt": [5, 103]}, "prompt", "mask token"),
    ({"prompt": [5, 104]}, "prompt", "out of range"),
    ({"prompt": "hi", "max_tokens": 600}, "prompt", "context length 512"),
    ({"prompt": "hi", "stop_token_ids": [999]}, "stop_token_ids", "[0, 104)"),
    ({"prompt": "hi", "echo": True}, "echo", "not supported"),
    ({"prompt": "hi", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param, words):
    client = server[0]
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_queue_is_bounded_and_a_client_that_leaves_frees_its_slot(server):
    client, model, tok, worker = server
    long = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "mode": "quality", "stream": True}
    with client.stream("POST", "/v1/completions", json=long) as r:
        next(r.iter_lines())                    # decoding: the one slot is taken
        (job,) = worker.jobs
        busy = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "server_busy"
    wait_until(lambda: worker.num_requests() == 0, timeout=30)
    assert isinstance(job.future.exception(), _Aborted)             # left mid-decode: stopped at a block's end
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) <= 4


def test_a_client_timeout_frees_the_slot_and_an_abort_ends_streams(server):
    client, model, tok, worker = server
    long = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "mode": "quality"}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=long, timeout=0.5)
    wait_until(lambda: worker.num_requests() == 0, timeout=30)
    with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(lines)
        worker.abort_all()                      # what shutdown does once its grace period is over
        events = sse_events("\n".join([first, *lines]))
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    wait_until(lambda: worker.num_requests() == 0, timeout=30)


def test_arbor_serve_serves_a_block_diffusion_folder(folder):
    port = free_port()
    cmd = [sys.executable, "-m", "arbor.cli", "serve", str(folder), "--port", str(port), "--served-model-name", "tiny",
           "server.diffusion_mode=threshold", "server.shutdown_grace_s=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12}, timeout=60).json()
        want = direct(load_model(folder).eval(), Tokenizer.load(folder), PROMPTS, "threshold")
        assert [c["token_ids"] for c in r["choices"]] == [w.tokens[:w.num_tokens] for w in want]
        assert httpx.get(url + "/v1/models").json()["data"][0]["default_mode"] == "threshold"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
