"""Bounded load test of `arbor serve` on 127.0.0.1 (≤ 30 s): 64 concurrent clients — 44 good ones
(streaming and not, completions and chat, greedy and seeded), 16 that leave early (dropped streams,
client timeouts), 4 bad requests — while a poller times /health. The clients run as their own
process (``tests/load_clients.py``); the server runs here, so its engine can be inspected. Every
good request must return exactly what a lone ``LLMEngine`` returns, every bad one a 400, no request
may be left in the engine, and /health must answer with p99 < 100 ms throughout. The figures are
printed (pytest -s) and quoted in the README."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.serve.server import build_app
from arbor.serve.config import ServerConfig
from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
from tests.server_helpers import running, tiny_folder, wait_until

CFG = dict(max_model_len=512, max_num_seqs=64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = ['{not json', '{"model": "tiny", "prompt": "x", "stop_token_ids": [[1]]}',
       '{"model": "tiny", "prompt": "x", "n": 99}', '{"model": "tiny", "prompt": "bad \\ud800"}']


def good_requests(tok) -> list[tuple[dict, list[int], SamplingParams]]:
    """44 jobs with deterministic outputs, each with its prompt ids and SamplingParams for the reference."""
    out = []
    for i in range(44):
        chat, stream = i % 4 == 1, i % 2 == 0
        knobs = {"max_tokens": 40 + (i * 37) % 360, "temperature": 0, "ignore_eos": i % 2 == 1} if i % 3 else \
            {"max_tokens": 20 + (i * 53) % 300, "temperature": 0.8, "top_p": 0.9, "seed": i}
        if chat:
            messages = [{"role": "user", "content": f"question {i}: what is {i} + {2 * i}?"}]
            body, ids = {"messages": messages}, tok.apply_chat_template(messages, add_generation_prompt=True)
        else:
            text = f"request {i} says " + "ab" * (i % 9)
            body, ids = {"prompt": text}, tok.encode(text)
        job = {"kind": "good", "path": "/v1/chat/completions" if chat else "/v1/completions",
               "body": {"model": "tiny", **body, **knobs, "stream": stream}}
        out.append((job, ids, SamplingParams(**knobs)))
    return out


def test_64_clients_a_quarter_leaving_early(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tiny_folder(tmp_path / "tiny")
    engine = ThreadedAsyncLLMEngine(str(folder), EngineConfig(**CFG))
    goods = good_requests(engine.tokenizer)
    ref = LLMEngine(str(folder), EngineConfig(**CFG)).generate([ids for _, ids, _ in goods], [p for *_, p in goods])
    jobs = [job for job, *_ in goods] + [{"kind": "leave", "i": i} for i in range(16)] + \
        [{"kind": "bad", "raw": raw} for raw in BAD]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    latencies, stop = [], threading.Event()
    try:
        with running(build_app(engine, "tiny", ServerConfig())) as url:
            def poll():
                with httpx.Client(base_url=url, timeout=5) as h:
                    while not stop.is_set():
                        t = time.perf_counter()
                        assert h.get("/health").status_code == 200
                        latencies.append(time.perf_counter() - t)
                        time.sleep(0.01)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            t0 = time.perf_counter()
            clients = subprocess.run([sys.executable, "-m", "tests.load_clients", url, str(tmp_path / "jobs.json")],
                                     capture_output=True, text=True, timeout=60, cwd=REPO)
            wall = time.perf_counter() - t0
            eng = engine.engine
            drained = wait_until(lambda: not eng.has_unfinished() and not eng.requests, timeout=5)
            stop.set()
            poller.join(5)
    finally:
        torch.set_num_threads(threads)
    assert clients.returncode == 0, clients.stderr[-3000:]
    results = json.loads(clients.stdout)
    assert len(results) == 64
    for i, r in enumerate(ref):
        assert results[str(i)] == [r.token_ids, r.text], i
    assert all(results[str(i)] is True for i in range(44, 60))
    assert not engine.queues and not engine.num_requests()
    assert eng.block_manager.num_free_blocks == len(eng.block_manager.blocks)
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]
    print(json.dumps({"wall_s": round(wall, 2), "health_polls": len(latencies), "health_p50_ms": round(1e3 * p50, 1),
                      "health_p99_ms": round(1e3 * p99, 1), "health_max_ms": round(1e3 * latencies[-1], 1),
                      "engine_steps": eng.num_steps, "drained_after_s": round(drained, 3)}))
    assert p99 < 0.1 and wall < 30
