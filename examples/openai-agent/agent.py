"""An agent written with the `openai` package and one function tool, as it would run against any
OpenAI-compatible server. `arbor train agent=examples/openai-agent/agent.py:run` trains it unchanged:
the client it gets points at the trainer's endpoint for one episode.
"""
import json

COLORS = {"banana": "yellow", "lime": "green", "plum": "purple", "cherry": "red", "orange": "orange",
          "blueberry": "blue"}


def color(fruit: str) -> str:
    """The color of a fruit.

    Args:
        fruit: the fruit's name, e.g. plum
    """
    return COLORS.get(fruit.strip().lower(), "unknown fruit")


TOOLS = [{"type": "function", "function": {
    "name": "color", "description": "The color of a fruit.",
    "parameters": {"type": "object", "required": ["fruit"],
                   "properties": {"fruit": {"type": "string", "description": "the fruit's name, e.g. plum"}}}}}]


def call_tool(call) -> str:
    """A tool call → its result; a bad call is answered with an error, as an agent framework would."""
    try:
        return color(**json.loads(call.function.arguments)) if call.function.name == "color" else "error: no such tool"
    except (TypeError, ValueError) as e:
        return f"error: {e}"


async def run(client, row) -> float:
    """Ask, run the tool calls the model makes, and score the final answer: 1.0 when it names the color."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == row["answer"])
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": call_tool(call)})
    return 0.0
