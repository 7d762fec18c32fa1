#!/usr/bin/env bash
# Math word problems end to end: make the data, SFT a tiny model on worked solutions, RL it with
# the built-in `math` reward, and print held-out accuracy after SFT and along RL.
#
#   bash examples/math-word-problems/run.sh [OUT]        # OUT defaults to runs/math-word-problems
#
# SEED=n picks the seed (data, SFT, RL); SMOKE=1 runs every stage for a few steps only (a check of
# the pipeline, nothing is learned); PYTHON names the interpreter that has Arbor (default: python).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/math-word-problems}
SEED=${SEED:-0}
PY=${PYTHON:-python}
if [ -n "${SMOKE:-}" ]; then
  TRAIN=64 TEST=8 SFT_STEPS=3 BATCH=1000 RL_STEPS=2 EVAL_EVERY=1 BUDGET=300
else
  TRAIN=4000 TEST=200 SFT_STEPS=1500 BATCH=4096 RL_STEPS=30 EVAL_EVERY=10 BUDGET=3000
fi
DATA="$OUT/data"
TOOLS="tools=[\"$HERE/tools.py:calc\"]"
ROWS=(data.train="$DATA/train.jsonl" data.eval="$DATA/test.jsonl" data.prompt_key=question
      'reward.fns=["math"]' "$TOOLS")
rm -rf "$OUT/sft" "$OUT/rl"             # start fresh: no checkpoint of an earlier run is resumed

"$PY" "$HERE/make_data.py" "$DATA" --seed "$SEED" --train "$TRAIN" --test "$TEST" --mental-rate 0.7

# 1. SFT: a tiny random model learns the conversations of sft.jsonl (tool calls and "in the head" answers).
"$PY" -m arbor sft model=tiny data.train="$DATA/sft.jsonl" "$TOOLS" out="$OUT/sft" \
  train.seed="$SEED" train.steps="$SFT_STEPS" train.batch_tokens="$BATCH" train.log_every=250 \
  train.optim.lr=3e-3 train.optim.min_lr_ratio=1.0 train.checkpoint_every=0

# 2. The SFT model's held-out accuracy (greedy, the same rows RL evaluates on).
"$PY" -m arbor eval "$OUT/sft" "${ROWS[@]}" --n "$TEST" | tee "$OUT/sft_eval.txt"

# 3. RL: GRPO on train.jsonl's questions, rewarded by math-verify against the answer after ####.
"$PY" -m arbor train model="$OUT/sft" out="$OUT/rl" "${ROWS[@]}" seed="$SEED" \
  steps="$RL_STEPS" eval_every="$EVAL_EVERY" eval_problems="$TEST" checkpoint_every=0 \
  rollout.temperature=0.7 'rollout.branch=[4,2]' optim.lr=3e-4 optim.warmup_steps=5 'optim.betas=[0.9,0.999]' \
  c3po.token_budget="$BUDGET" c3po.capacity=24

"$PY" "$HERE/../held_out.py" "$OUT"
