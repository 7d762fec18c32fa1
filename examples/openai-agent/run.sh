#!/usr/bin/env bash
# An agent written with the `openai` package and a function tool, trained unchanged through the
# trainer's OpenAI-compatible endpoint (agent=agent.py:run); then the same agent rewriting its history
# (agent=rewriting_agent.py:run: the tree path). SFT first, so that the tiny model knows the format.
#
#   bash examples/openai-agent/run.sh [OUT]    # OUT defaults to runs/openai-agent; SMOKE=1: a few steps only
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/openai-agent}
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then
  SFT_STEPS=5 RL_STEPS=1 EVAL_EVERY=1 TEST=4 BUDGET=100
else
  SFT_STEPS=300 RL_STEPS=60 EVAL_EVERY=20 TEST=36 BUDGET=1200
fi
rm -rf "$OUT/sft" "$OUT/rl" "$OUT/rl-rewrite"     # start fresh: no checkpoint of an earlier run is resumed

"$PY" "$HERE/make_data.py" "$OUT/data"
"$PY" -m arbor sft model=tiny data.train="$OUT/data/sft.jsonl" tools="[\"$HERE/agent.py:color\"]" out="$OUT/sft" \
  train.steps="$SFT_STEPS" train.batch_tokens=2048 train.optim.lr=3e-3 train.checkpoint_every=0 log.progress=false
ROWS=(data.train="$OUT/data/train.jsonl" data.eval="$OUT/data/test.jsonl" eval.samples=8)
RL=(steps="$RL_STEPS" eval_every="$EVAL_EVERY" eval_problems="$TEST" rollout.branch=[8] rollout.max_context=320
    c3po.token_budget="$BUDGET" optim.lr=5e-5 optim.warmup_steps=5 "optim.betas=[0.9,0.999]" checkpoint_every=0
    log.progress=false)
"$PY" -m arbor eval "$OUT/sft" agent="$HERE/agent.py:run" "${ROWS[@]}" --n "$TEST" | tee "$OUT/sft_eval.txt"
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" agent="$HERE/agent.py:run" "${ROWS[@]}" "${RL[@]}"
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl-rewrite" agent="$HERE/rewriting_agent.py:run" "${ROWS[@]}" "${RL[@]}"

"$PY" "$HERE/../held_out.py" "$OUT"
"$PY" "$HERE/figures.py" "$OUT"
