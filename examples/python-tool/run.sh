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
  N=2000 TEST=100 SFT_STEPS=1000 RL_STEPS=20 EVAL_EVERY=10 BUDGET=3000
fi
rm -rf "$OUT/sft" "$OUT/rl"             # start fresh: no checkpoint of an earlier run is resumed
TOOLS='tools=["arbor.tasks.python_tool:python"]'
"$PY" -c "from arbor.tasks.python_tool import check_sandbox; check_sandbox()"

"$PY" "$HERE/../write_rows.py" python "$OUT/data" --train "$N" --test "$TEST"
"$PY" -m arbor sft model=tiny data.train="$OUT/data/train.jsonl" "$TOOLS" out="$OUT/sft" \
  train.steps="$SFT_STEPS" train.optim.lr=3e-3 train.checkpoint_every=0
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" data.train="$OUT/data/train.jsonl" data.eval="$OUT/data/test.jsonl" \
  "$TOOLS" 'reward.fns=["arbor.tasks.python_tool:reward"]' steps="$RL_STEPS" eval_every="$EVAL_EVERY" \
  eval_problems="$TEST" rollout.max_turn_tokens=256 rollout.max_context=1536 c3po.token_budget="$BUDGET" checkpoint_every=0
