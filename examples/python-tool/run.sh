#!/usr/bin/env bash
# The built-in python task from files: rows written by ../write_rows.py, the sandboxed `python` tool and
# the reward named by their Python paths (what `arbor train task=python` loads by itself). The tool
# runs each program in arbor.rollout.sandbox; where that sandbox can only isolate weakly, the check
# below stops (ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1 accepts it: see docs/rl.md).
#
#   bash examples/python-tool/run.sh [OUT]    # OUT defaults to runs/python-tool; SMOKE=1: a few steps only
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/python-tool}
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then
  N=32 TEST=4 SFT_STEPS=3 RL_STEPS=1 EVAL_EVERY=1 BUDGET=300
else
  N=4000 TEST=200 SFT_STEPS=1500 RL_STEPS=30 EVAL_EVERY=10 BUDGET=3000
fi
rm -rf "$OUT/sft" "$OUT/rl"             # start fresh: no checkpoint of an earlier run is resumed
TOOLS='tools=["arbor.tasks.python_tool:python"]'
"$PY" -c "from arbor.tasks.python_tool import check_sandbox; check_sandbox()"

"$PY" "$HERE/../write_rows.py" python "$OUT/data" --train "$N" --test "$TEST"
"$PY" -m arbor sft model=tiny data.train="$OUT/data/train.jsonl" "$TOOLS" out="$OUT/sft" \
  train.steps="$SFT_STEPS" train.checkpoint_every=0
REWARD='reward.fns=["arbor.tasks.python_tool:reward"]'
ROWS=(data.train="$OUT/data/train.jsonl" data.eval="$OUT/data/test.jsonl" "$TOOLS" "$REWARD")
"$PY" -m arbor eval "$OUT/sft" "${ROWS[@]}" rollout.max_turn_tokens=256 rollout.max_context=1536 --n "$TEST" \
  | tee "$OUT/sft_eval.txt"
# RL from a strong SFT start takes small steps: at the default optim.lr=2e-4 held-out accuracy fell (81.5 % → 56 %).
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" "${ROWS[@]}" steps="$RL_STEPS" eval_every="$EVAL_EVERY" \
  eval_problems="$TEST" optim.lr=3e-5 rollout.max_turn_tokens=256 rollout.max_context=1536 c3po.token_budget="$BUDGET" \
  checkpoint_every=0

"$PY" "$HERE/../held_out.py" "$OUT"
