"""Write the built-in longtail task as files: OUT_DIR/train.jsonl and OUT_DIR/test.jsonl.

    python make_data.py OUT_DIR [--train 2000] [--test 100] [--seed 0]

The rows are those of ``arbor.tasks.longtail.rows`` (what ``task=longtail`` trains on): ``prompt``,
``letter`` and ``length`` (what ``LongTailEnvironment.reset(row)`` reads) and ``messages`` (a
demonstration, for SFT).
"""

import argparse
import json
from pathlib import Path

from arbor.tasks.longtail import rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", a.train, a.seed), ("test", a.test, a.seed + 1)):
        with open(Path(a.out) / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(n, seed, split))
    print(f"wrote {a.train} train and {a.test} test rows to {a.out}")


if __name__ == "__main__":
    main()
