"""Agents of the agent tests, written as a user writes them: plain ``openai`` client code.

Each one appends what it saw to ``SEEN`` (the episode handle and the token ids of every response), so a
test can compare what went over HTTP with what the trainer recorded."""

import asyncio

SEEN: list = []
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"]}}}]


async def tool_agent(client, row):
    """Three chat turns with a tool offered; the second streamed; every turn answered by a tool message."""
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = []
    for turn in range(3):
        kw = dict(model="gpt-4o-mini", messages=messages, tools=TOOLS, max_tokens=8, temperature=0.3)
        if turn == 1:
            ids, text, calls = [], "", []
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    ids += c.model_extra.get("token_ids") or []
                    text += c.delta.content or ""
                    calls += [t.model_dump() for t in c.delta.tool_calls or []]
            message = {"role": "assistant", "content": text}     # content is required without tool calls
            if calls:
                message.update(content=text or None, tool_calls=calls)
        else:
            r = await client.chat.completions.create(**kw)
            ids, message = r.choices[0].model_extra["token_ids"], r.choices[0].message.model_dump(exclude_none=True)
        seen.append(ids)
        messages.append(message)
        for c in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "42"})
        if not message.get("tool_calls"):
            messages.append({"role": "tool", "content": "no call was made; the sum is 42"})
    SEEN.append((client.episode, seen, messages))
    return float(row["n"] % 3)


async def bad_agent(client, row):
    """Behaves as ``row["kind"]`` says: a good episode, or one of the ways an agent goes wrong."""
    kind = row["kind"]
    if kind == "silent":
        return 1.0
    await client.chat.completions.create(model="arbor-policy", messages=[{"role": "user", "content": kind}],
                                         max_tokens=4)
    if kind == "raise":
        raise RuntimeError("the agent's own bug")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "text":
        return "correct"
    if kind == "nan":
        return float("nan")
    if kind == "set":
        client.episode.reward(0.75)
        return None
    return 1.0


async def rewriting_agent(client, row):
    """Continues a chat, then rewrites its history (a summary instead of the turns), then opens a
    second thread with a plain completion: the tree and split paths."""
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": row["prompt"]}]
    kw = dict(model="arbor-policy", max_tokens=6)
    r1 = await client.chat.completions.create(messages=first, **kw)
    second = first + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    await client.chat.completions.create(messages=second, **kw)
    rewritten = [system, {"role": "user", "content": row["prompt"] + " (summary: brief)"}]
    await client.chat.completions.create(messages=rewritten, **kw)
    client.episode.reward_call(0.5)          # the rewritten thread's own reward
    await client.completions.create(prompt="zz" + row["prompt"], **kw)
    SEEN.append((client.episode, [], []))
    return 1.0
