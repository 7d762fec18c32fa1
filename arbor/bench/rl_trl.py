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

``python -m arbor.bench.rl_trl e2e --model DIR --train ROWS.jsonl --out DIR --config GRPO.json …`` is the
TRL side of ``arbor bench e2e`` (``arbor.bench.e2e``): ``GRPOTrainer`` with the GRPOConfig keys of
GRPO.json on the rows' ``question`` column as a user turn, rewarded by Arbor's built-in ``math``
reward (``arbor.data.reward_builtins``) on the last assistant message, with ``--tools file.py:fn``
passed as ``tools=`` (TRL's own tool loop); the model is saved as an HF folder on the clock of
``arbor.bench.e2e_worker.TrainClock`` (saves off the clock) until ``--seconds`` have passed.

``ensure_trl()`` installs the pinned TRL beside Arbor when it is missing (pip, into this interpreter),
or says why it cannot.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_VERSION = "1.16.0"      # the release the benches compare against


def ensure_trl(version: str = TRL_VERSION) -> str:
    """The installed TRL's version; installs ``trl==version`` with pip when none is (a dry run first: it
    must not change torch or transformers). SystemExit with the reason when it cannot."""
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        pass
    pip = [sys.executable, "-m", "pip", "install", f"trl=={version}"]
    dry = subprocess.run(pip + ["--dry-run"], capture_output=True, text=True)
    would = next((x for x in dry.stdout.splitlines() if x.startswith("Would install")), "")
    clash = [w for w in would.split()[2:] if w.split("-")[0] in ("torch", "transformers")]
    if dry.returncode != 0 or clash:
        raise SystemExit(f"TRL {version} is not installed and cannot be installed beside Arbor here: "
                         + (f"it would replace {', '.join(clash)}" if clash else dry.stderr.strip()[-800:])
                         + f"\ninstall it yourself (pip install trl=={version}), or run with --trl off")
    print(f"installing trl=={version} beside Arbor ({sys.executable} -m pip)", flush=True)
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip install trl=={version} failed:\n{done.stderr.strip()[-1500:]}")
    return importlib.metadata.version("trl")


def reward(completions, **kwargs) -> list[float]:
    from arbor.bench.rl_workloads import score
    return [score(c if isinstance(c, str) else c[-1]["content"]) for c in completions]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["e2e"]:
        return e2e(argv[1:])
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


def last_answer(completion) -> str:
    """The text the ``math`` reward scores: a plain completion, or the last assistant message's content."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role") == "assistant"]
    return (said[-1].get("content") or "") if said else ""


def e2e(argv) -> None:
    start = time.perf_counter()
    from arbor.bench.e2e_worker import add_clock_arguments
    p = argparse.ArgumentParser(prog="python -m arbor.bench.rl_trl e2e")
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="rows (.jsonl) with the prompt column and `answer`")
    p.add_argument("--prompt-key", default="question")
    p.add_argument("--config", required=True, help="JSON of GRPOConfig keys (arbor.bench.e2e.trl_config)")
    p.add_argument("--tools", nargs="*", default=[], help="file.py:function, passed as tools=")
    p.add_argument("--out", required=True)
    add_clock_arguments(p)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from arbor.bench.e2e_worker import clock_of
    from arbor.data.objects import load_object
    from arbor.data.reward_builtins import builtin

    clock = clock_of(a, start)
    rows = [json.loads(x) for x in open(a.train) if x.strip()]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": r[a.prompt_key]}] for r in rows],
                              "answer": [r["answer"] for r in rows]})
    score = builtin("math", 0)[0]

    def math(completions, answer, **kwargs) -> list[float]:
        return [score(None, last_answer(c), answer=x) for c, x in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    steps: list[int] = []
    ends: list[float] = []

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append(state.global_step)
            ends.append(clock.now())
            if clock.due():
                m = kw.get("model") or model
                clock.snapshot(state.global_step, lambda path: (m.save_pretrained(path), tok.save_pretrained(path)))
            if clock.done():
                control.should_training_stop = True

    with tempfile.TemporaryDirectory() as out:
        cfg = trl.GRPOConfig(output_dir=out, seed=a.seed, use_cpu=True, save_strategy="no", report_to=[],
                             logging_steps=10 ** 6, disable_tqdm=True, dataloader_num_workers=0,
                             **json.loads(Path(a.config).read_text()))
        trainer = trl.GRPOTrainer(model=model, reward_funcs=math, args=cfg, processing_class=tok, train_dataset=data,
                                  tools=[load_object(t, "tools") for t in a.tools] or None, callbacks=[Snapshots()])
        trainer.train()
    print("RESULT " + json.dumps({"trl": trl.__version__, "snapshots": clock.saves, "steps": steps[-1] if steps else 0,
                                  "step_end_s": ends,
                                  "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
