#!/usr/bin/env bash
# The built-in countdown task from files: rows written by ../write_rows.py, the calculator tool and the
# reward named by their Python paths (what `arbor train task=countdown` loads by itself).
#
#   bash examples/countdown/run.sh [OUT]      # OUT defaults to runs/countdown; SMOKE=1: a few steps only
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/countdown}
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then
  N=64 TEST=8 SFT_STEPS=3 RL_STEPS=2 EVAL_EVERY=1 BUDGET=300
else
  N=4000 TEST=200 SFT_STEPS=1000 RL_STEPS=30 EVAL_EVERY=10 BUDGET=3000
fi
rm -rf "$OUT/sft" "$OUT/rl"             # start fresh: no checkpoint of an earlier run is resumed
TOOLS='tools=["arbor.tasks.arithmetic:calc"]'

"$PY" "$HERE/../write_rows.py" countdown "$OUT/data" --train "$N" --test "$TEST"
"$PY" -m arbor sft model=tiny data.train="$OUT/data/train.jsonl" "$TOOLS" out="$OUT/sft" \
  train.steps="$SFT_STEPS" train.optim.lr=3e-3 train.checkpoint_every=0
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" data.train="$OUT/data/train.jsonl" data.eval="$OUT/data/test.jsonl" \
  "$TOOLS" 'reward.fns=["arbor.tasks.countdown_chat:reward"]' steps="$RL_STEPS" eval_every="$EVAL_EVERY" \
  eval_problems="$TEST" 'rollout.branch=[4,2]' rollout.temperature=0.7 c3po.token_budget="$BUDGET" checkpoint_every=0
