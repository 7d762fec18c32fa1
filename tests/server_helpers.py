"""Helpers of the server tests: a tiny model folder, and an app served by uvicorn on 127.0.0.1 in a thread."""

import contextlib
import json
import socket
import threading
import time

import torch
import uvicorn

from arbor.models import CausalLM, ModelConfig, save_model
from arbor.models.tokenizer import builtin_tokenizer


def tiny_folder(folder, seed: int = 0):
    """A random 2-layer model (vocab 128) with the built-in tokenizer, saved as an HF folder."""
    tok = builtin_tokenizer()
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                                 eos_token_id=tok.eos_token_id)).eval()
    save_model(model, folder, tokenizer=tok)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """Serve ``app`` on 127.0.0.1 in a daemon thread → its base URL; stopped on exit."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        timeout_graceful_shutdown=1))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(5)


def sse_events(text: str) -> list[dict]:
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def wait_until(cond, timeout: float = 5.0, every: float = 0.002) -> float:
    """Seconds until ``cond()`` held (AssertionError after ``timeout``)."""
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout, "condition not reached in time"
        time.sleep(every)
    return time.perf_counter() - t0
