"""Print an example run's held-out accuracy: after SFT (``OUT/sft_eval.txt``, what ``arbor eval`` printed)
and at each RL evaluation (``OUT/rl/metrics.jsonl``).

    python examples/held_out.py OUT
"""
import json
import re
import sys

out = sys.argv[1]
before = re.search(r"test_accuracy ([0-9.]+)%", open(f"{out}/sft_eval.txt").read())
after = [f"{row['test_accuracy']:.1%} (RL step {row['step'] + 1})" for row in map(json.loads, open(f"{out}/rl/metrics.jsonl"))
         if "test_accuracy" in row]
print(f"held-out accuracy: {before.group(1) if before else '?'}% after SFT → " + " → ".join(after))
