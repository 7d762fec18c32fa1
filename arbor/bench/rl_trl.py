"""TRL's ``GRPOTrainer`` on a model folder, timed per step — the subprocess side of ``arbor bench rl``.

``python -m arbor.bench.rl_trl --model DIR --prompts FILE.json --generations G --completion C
--batch-prompts P --steps N --threads T`` trains ``N + 1`` steps (the first is a warm-up) of P
prompts × G completions of exactly C tokens (``min_new_tokens`` = C, so EOS cannot end one
early), float32 on the CPU (or ``--device cuda``), no gradient checkpointing (TRL's default is on;
Arbor's is off), beta = 0 (no reference model), one
optimizer step per generation batch (TRL then skips the old-log-prob pass), no vLLM; reward = the
share of letters a…j (``rl_workloads.score``). Step time = wall time between successive
``on_step_end`` callbacks. Prints one line ``RESULT {json}`` with the per-step seconds, the
completion tokens per step and the TRL version. Kept apart so that ``trl`` (and what it imports)
never loads into the bench process.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def reward(completions, **kwargs) -> list[float]:
    from arbor.bench.rl_workloads import score
    return [score(c if isinstance(c, str) else c[-1]["content"]) for c in completions]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m arbor.bench.rl_trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt strings (already chat-templated)")
    p.add_argument("--batch-prompts", type=int, required=True)
    p.add_argument("--generations", type=int, required=True)
    p.add_argument("--completion", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lr", type=float, default=2e-4)
    a = p.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    prompts = json.loads(open(a.prompts).read())
    need = a.batch_prompts * (a.steps + 1)
    if len(prompts) < need:
        raise SystemExit(f"need {need} prompts for {a.steps + 1} steps of {a.batch_prompts}, got {len(prompts)}")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        cfg = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=a.batch_prompts * a.generations, num_generations=a.generations,
            max_completion_length=a.completion, generation_kwargs={"min_new_tokens": a.completion},
            max_steps=a.steps + 1, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
            temperature=1.0, num_iterations=1, use_vllm=False, bf16=False, fp16=False, use_cpu=a.device == "cpu",
            save_strategy="no", report_to=[], logging_steps=10 ** 6, disable_tqdm=True, seed=0, shuffle_dataset=False,
            dataloader_num_workers=0, gradient_accumulation_steps=1, gradient_checkpointing=False)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": prompts[:need]}), callbacks=[Clock()])
        t0 = time.perf_counter()
        trainer.train()
    steps = [b - a_ for a_, b in zip([t0] + ends[:-1], ends)]
    prompt_tokens = sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in prompts[:need]) / need
    print("RESULT " + json.dumps({"trl": trl.__version__, "step_s": steps[1:], "warmup_s": steps[0],
                                  "completion_tokens_per_step": a.batch_prompts * a.generations * a.completion,
                                  "prompt_tokens_mean": prompt_tokens, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
