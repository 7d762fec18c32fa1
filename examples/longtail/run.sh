#!/usr/bin/env bash
# The built-in longtail task from files: rows written by ../write_rows.py and an environment class named
# by its Python path (env=…: it builds each prompt from the row and scores the turn itself, so no
# reward.fns or tools). Its output lengths are long-tailed: the workload C3PO++ is for.
#
#   bash examples/longtail/run.sh [OUT]       # OUT defaults to runs/longtail; SMOKE=1: a few steps only
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/longtail}
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then
  N=32 TEST=4 SFT_STEPS=3 RL_STEPS=2 EVAL_EVERY=1 BUDGET=300
else
  N=2000 TEST=100 SFT_STEPS=200 RL_STEPS=20 EVAL_EVERY=10 BUDGET=3000
fi
rm -rf "$OUT/sft" "$OUT/rl"             # start fresh: no checkpoint of an earlier run is resumed

"$PY" "$HERE/../write_rows.py" longtail "$OUT/data" --train "$N" --test "$TEST"
"$PY" -m arbor sft model=tiny data.train="$OUT/data/train.jsonl" out="$OUT/sft" \
  train.steps="$SFT_STEPS" train.checkpoint_every=0
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" data.train="$OUT/data/train.jsonl" data.eval="$OUT/data/test.jsonl" \
  env=arbor.tasks.longtail:LongTailEnvironment steps="$RL_STEPS" eval_every="$EVAL_EVERY" eval_problems="$TEST" \
  rollout.max_context=400 c3po.token_budget="$BUDGET" checkpoint_every=0
