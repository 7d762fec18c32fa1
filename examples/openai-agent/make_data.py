"""Write the fruit-color rows: ``train.jsonl`` / ``test.jsonl`` (``prompt``, ``answer``; held-out rows
ask about other people) and ``sft.jsonl`` (conversations: a quarter of them call the ``color`` tool,
the rest guess a color, so the SFT model mostly guesses).

    python examples/openai-agent/make_data.py OUT_DIR
"""
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from agent import COLORS  # noqa: E402

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Ida", "Jon", "Kim", "Lou", "Max", "Ned", "Ola",
         "Pam", "Roy", "Sam", "Tia", "Uma", "Vic"]


def rows(names):
    return [{"prompt": f"What color is {n}'s {f}?", "answer": c} for n in names for f, c in COLORS.items()]


def main(out: Path) -> None:
    rng = random.Random(0)
    train, test = rows(NAMES[:14]), rows(NAMES[14:])
    sft = []
    for row in train * 2:
        fruit = row["prompt"].rsplit(" ", 1)[1].rstrip("?")
        msgs = [{"role": "user", "content": row["prompt"]}]
        if rng.random() < 0.25:
            call = {"type": "function", "function": {"name": "color", "arguments": {"fruit": fruit}}}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": row["answer"]}]
            msgs.append({"role": "assistant", "content": row["answer"]})
        else:
            msgs.append({"role": "assistant", "content": rng.choice(list(COLORS.values()))})
        sft.append({"messages": msgs})
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("train.jsonl", train), ("test.jsonl", test), ("sft.jsonl", sft)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"wrote {len(train)} train, {len(test)} test, {len(sft)} SFT rows to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
