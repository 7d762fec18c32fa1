"""Write the built-in arithmetic task as files: OUT_DIR/train.jsonl and OUT_DIR/test.jsonl.

    python make_data.py OUT_DIR [--train 2000] [--test 200] [--seed 0] [--mental-rate 0.7]

The rows are those of ``arbor.tasks.arithmetic.rows`` (what ``task=arithmetic`` trains on): ``prompt``
(the system and user messages), ``answer`` and ``messages`` (a calculator demonstration, for SFT).
"""

import argparse
import json
from pathlib import Path

from arbor.tasks.arithmetic import rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mental-rate", type=float, default=0.7)
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", a.train, a.seed), ("test", a.test, a.seed + 1)):
        with open(Path(a.out) / f"{split}.jsonl", "w") as f:
            for row in rows(n, seed, split, mental_rate=a.mental_rate):
                first_answer = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
                f.write(json.dumps({**row, "prompt": row["messages"][:first_answer]}) + "\n")
    print(f"wrote {a.train} train and {a.test} test rows to {a.out}")


if __name__ == "__main__":
    main()
