"""The clients of tests/test_server_load.py, run as their own process (so that their work does not
share the server's GIL): ``python -m tests.load_clients URL JOBS.json`` prints one JSON object
{job index: result} on stdout. A job is {"kind": "good", "path", "body"} → [token ids, text];
{"kind": "leave", "i"} (a dropped stream or a client timeout) → true; {"kind": "bad", "raw"} → the
400's error message."""

import asyncio
import json
import sys

import httpx


def sse_events(text: str) -> list[dict]:
    lines = [line for line in text.split("\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-1]
    return [json.loads(line[6:]) for line in lines[:-1]]


async def good(client, path: str, body: dict):
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    chat = "chat" in path
    if not body["stream"]:
        c = r.json()["choices"][0]
        return [c["token_ids"], c["message"]["content"] if chat else c["text"]]
    events = sse_events(r.text)
    ids = sum((e["choices"][0]["token_ids"] for e in events), [])
    text = "".join(e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"] for e in events)
    return [ids, text]


async def leave(client, i: int):
    body = {"model": "tiny", "prompt": f"long {i}", "max_tokens": 400, "ignore_eos": True}
    if i % 2:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n >= 4 + i % 5:
                    return True
        raise AssertionError("the stream ended before the client left")
    try:
        await client.post("/v1/completions", json=body, timeout=0.2 + 0.05 * (i % 4))
    except httpx.ReadTimeout:
        return True
    raise AssertionError("the request ended before the client's timeout")


async def bad(client, raw: str):
    r = await client.post("/v1/completions", content=raw.encode("latin-1"),
                          headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


async def main(url: str, jobs: list[dict]) -> dict:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        run = {"good": lambda j: good(client, j["path"], j["body"]), "leave": lambda j: leave(client, j["i"]),
               "bad": lambda j: bad(client, j["raw"])}
        results = await asyncio.gather(*(run[j["kind"]](j) for j in jobs))
    return dict(enumerate(results))


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        print(json.dumps(asyncio.run(main(sys.argv[1], json.load(f)))))
