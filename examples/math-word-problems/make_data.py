"""Write a small math word-problem dataset in the GSM8K schema (generated here, nothing downloaded).

    python make_data.py OUT_DIR [--seed 0] [--train 4000] [--test 200] [--mental-rate 0.7]

OUT_DIR/train.jsonl and OUT_DIR/test.jsonl: rows ``{"question", "answer"}``, the answer a worked
solution ending in ``#### N`` as in GSM8K; the two files never share a question. OUT_DIR/sft.jsonl:
the train questions as conversations (``messages``) of a solver that calls the ``calc`` tool
(tools.py) once per step, then replies ``Answer: N``. On ``--mental-rate`` of the problems with at
most two steps it answers at once instead, "in its head": a tiny model imitates that habit but
cannot do the arithmetic, which leaves RL something to fix (it learns to reach for the tool).
OUT_DIR/sft_worked.jsonl: the same questions as conversations of a solver without tools that writes
each step's arithmetic out (``8*7=56``) before ``Answer: N``, for a model that must compute in writing.
Every file is a pure function of the arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Ida", "Jon", "Kim", "Lou", "Max", "Ned", "Ola", "Pam",
         "Roy", "Sam", "Tia", "Uma", "Vic"]
THINGS = ["apples", "pens", "cards", "shells", "coins", "stamps", "beads", "books", "eggs", "rocks"]


def problem(rng: random.Random) -> tuple[str, list[tuple[str, str, int]], int]:
    """One word problem: (question, [(sentence, step expression, its value)], answer); 1 to 3 steps."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    n_steps = rng.randint(1, 3)
    if rng.random() < 0.5:                  # the multiplication is the first step
        bags, each = rng.randint(2, 9), rng.randint(3, 15)
        value = bags * each
        steps = [(f"{name} buys {bags} bags of {each} {thing}.", f"{bags}*{each}", value)]
        opening = ""
    else:
        value, steps = rng.randint(10, 60), []
        opening = f"{name} has {value} {thing}. "
    while len(steps) < n_steps:
        b = rng.randint(2, 30)
        if rng.random() < 0.5 or b >= value:
            steps.append((f"{name} gets {b} more.", f"{value}+{b}", value + b))
            value += b
        else:
            steps.append((f"{name} gives away {b}.", f"{value}-{b}", value - b))
            value -= b
    text = opening + " ".join(s for s, _, _ in steps)
    return f"{text} How many {thing} does {name} have now?", steps, value


def solution(steps: list[tuple[str, str, int]], answer: int) -> str:
    """GSM8K's answer format: one line per step with a <<calculator>> annotation, then #### N."""
    lines = [f"{expr} = <<{expr}={value}>>{value}" for _, expr, value in steps]
    return "\n".join(lines) + f"\n#### {answer}"


def messages(question: str, steps: list[tuple[str, str, int]], answer: int, mental_rate: float) -> list[dict]:
    """The solver's conversation: a calc call per step, or (mental) the answer at once."""
    msgs = [{"role": "user", "content": question}]
    unit = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    if not (len(steps) <= 2 and unit < mental_rate):
        for _, expr, value in steps:
            call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            msgs.append({"role": "tool", "name": "calc", "content": str(value)})
    msgs.append({"role": "assistant", "content": f"Answer: {answer}"})
    return msgs


def worked(question: str, steps: list[tuple[str, str, int]], answer: int) -> list[dict]:
    """The toolless solver's conversation: one ``expr=value`` line per step, then the answer."""
    work = "\n".join(f"{expr}={value}" for _, expr, value in steps)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": f"{work}\nAnswer: {answer}"}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--mental-rate", type=float, default=0.7)
    a = p.parse_args()
    rng, seen, problems = random.Random(a.seed), set(), []
    while len(problems) < a.train + a.test:
        q, steps, answer = problem(rng)
        if q not in seen:                     # unique questions: the splits cannot overlap
            seen.add(q)
            problems.append((q, steps, answer))
    test, train = problems[:a.test], problems[a.test:]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train.jsonl", [{"question": q, "answer": solution(s, n)} for q, s, n in train])
    write(out / "test.jsonl", [{"question": q, "answer": solution(s, n)} for q, s, n in test])
    write(out / "sft.jsonl", [{"messages": messages(q, s, n, a.mental_rate)} for q, s, n in train])
    write(out / "sft_worked.jsonl", [{"messages": worked(q, s, n)} for q, s, n in train])
    print(f"wrote {len(train)} train, {len(test)} test and 2 × {len(train)} SFT rows to {out}")


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
