"""The example's before/after figure: held-out accuracy after SFT (``OUT/sft_eval.txt``) and at each RL
evaluation of both agents (``OUT/rl/metrics.jsonl``, ``OUT/rl-rewrite/metrics.jsonl``) →
``OUT/openai-agent.png``; the same numbers are printed.

    python examples/openai-agent/figures.py OUT
"""
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1])
before = float(re.search(r"test_accuracy ([0-9.]+)%", (out / "sft_eval.txt").read_text()).group(1)) / 100
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, label in (("rl", "agent.py (one trajectory per episode)"), ("rl-rewrite", "rewriting_agent.py (a tree)")):
    log = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    points = [(0, before)] + [(r["step"] + 1, r["test_accuracy"]) for r in log if "test_accuracy" in r]
    ax.plot(*zip(*points), "o-", label=label)
    print(f"{name}: held-out accuracy " + " → ".join(f"{a:.1%} (step {s})" for s, a in points))
ax.set_xlabel("RL step (0: after SFT)")
ax.set_ylabel("held-out accuracy")
ax.set_ylim(0, 1)
ax.legend(fontsize=8)
ax.set_title("fruit colors: an openai-client agent trained through Arbor's endpoint", fontsize=9)
fig.tight_layout()
fig.savefig(out / "openai-agent.png", dpi=120)
print(f"wrote {out / 'openai-agent.png'}")
