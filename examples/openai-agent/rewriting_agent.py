"""The same agent, except that it rewrites its history: after a tool call it does not send the call and
its result back as turns, but a new question that states the result. The second call's prompt then
does not extend the first call's prompt + completion, so Arbor trains the episode as a tree: the shared
prefix (system prompt, tools, the start of the question) once, one leaf per call.
"""
from agent import TOOLS, call_tool


async def run(client, row) -> float:
    question = row["prompt"]
    for _ in range(3):
        reply = await client.chat.completions.create(model="gpt-4o-mini", tools=TOOLS, max_tokens=64,
                                                     messages=[{"role": "user", "content": question}])
        message = reply.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == row["answer"])
        facts = "; ".join(call_tool(call) for call in message.tool_calls)
        question = f"{row['prompt']} (the color tool says: {facts})"
    return 0.0
