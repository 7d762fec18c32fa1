"""Write a built-in task's rows as files: OUT_DIR/train.jsonl and OUT_DIR/test.jsonl.

    python examples/write_rows.py TASK OUT_DIR [--train 2000] [--test 200] [--seed 0] [--option KEY=VALUE …]

TASK is a built-in task (arithmetic, countdown, python, longtail); its rows come from the generator
``task=TASK`` trains on (``arbor.tasks.registry.BUILTINS``), ``--option`` values (JSON) go to it
(e.g. ``--option mental_rate=0.7``). Each row keeps its columns (the reward's and the environment's)
and its demonstration in ``messages`` (for SFT); ``prompt`` becomes the demonstration's messages
before its first answer (system + user), so the RL run needs no ``data.system``. Test rows use
seed + 1, as the built-in task does.
"""

import argparse
import json
from pathlib import Path

from arbor.data.objects import load_object
from arbor.tasks.registry import BUILTINS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=sorted(BUILTINS))
    p.add_argument("out")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE (JSON) for the row generator")
    a = p.parse_args()
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in a.option)}
    rows = load_object(BUILTINS[a.task].rows, "task")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", a.train, a.seed), ("test", a.test, a.seed + 1)):
        with open(Path(a.out) / f"{split}.jsonl", "w") as f:
            for row in rows(n, seed, split, **options):
                first_answer = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
                f.write(json.dumps({**row, "prompt": row["messages"][:first_answer]}) + "\n")
    print(f"wrote {a.train} train and {a.test} test rows of {a.task} to {a.out}")


if __name__ == "__main__":
    main()
