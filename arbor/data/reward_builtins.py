"""Arbor's built-in reward functions, named in ``RewardConfig.fns`` by a word instead of a file.

Each built-in is an Arbor-form function ``f(prompt, completion, **row) -> float`` (``completion``:
the model's final answer text). The reference answer of ``math`` and ``exact`` is
``reference_answer(row)``: the first of the columns ``answer``, ``ground_truth``, ``solution``,
``reward_model.ground_truth`` (verl's dict column) that is present and not null, as a string, with
only the text after its last ``####`` kept when it has one (GSM8K's ``"… #### 72"`` → ``"72"``),
stripped. A row with none of them is an error of that row (counted, not fatal by default).

- ``math``: ``1.0`` if math-verify finds the completion equal to the reference answer, else ``0.0``:
  ``verify(parse(answer), parse(completion))``. On the completion ``parse`` takes ``\\boxed{…}``
  first, then the number after an anchor such as "Answer:" / "the answer is", else the last number
  or expression in the text ("The answer is 72." → 72, "Answer: 72" → 72, "… 5 then 72" → 72).
  A completion with nothing to parse scores 0.0; a reference answer with nothing to parse is an
  error. math-verify's own signal-based timeouts are off (they only work in the main thread and
  Arbor runs this in a worker thread); ``RewardConfig.timeout_s`` bounds the call instead.
  math-verify (with sympy, ≈ 0.5 s) is imported when the reward is first scored, on a daemon
  thread (``math_verify_import``), so neither the set-up of a run nor the event loop waits for it:
  the engine keeps decoding meanwhile. The function's ``ready()`` starts that import and returns its
  future, which ``Rewards`` awaits before a call's ``timeout_s`` starts. A missing package is still a
  ValueError when the reward is built (``importlib.util.find_spec``).
- ``exact``: ``1.0`` if ``completion.strip() == reference_answer(row)`` (already stripped), else
  ``0.0``; case and inner whitespace count.
- ``regex:PATTERN``: ``1.0`` if ``re.search(PATTERN, completion)`` finds a match, else ``0.0``; no
  flags (write ``(?s)``, ``(?i)`` inline). A pattern that does not compile is a ValueError at load.
- ``length_penalty``: with ``L = len(completion)`` in characters and ``T = length_target``,
  ``-min(1, max(0, L - T) / T)``: 0 up to ``T`` characters, then linear down to -1 at ``2T`` and
  -1 beyond (DAPO's soft overlong punishment, in characters). Never positive.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from concurrent.futures import Future

ANSWER_COLUMNS = ("answer", "ground_truth", "solution", "reward_model.ground_truth")
NAMES = ("math", "exact", "length_penalty", "regex:PATTERN")


def is_builtin(spec: str) -> bool:
    return spec in ("math", "exact", "length_penalty") or spec.startswith("regex:")


def reference_answer(row: dict) -> str:
    """The row's reference answer (module docstring), or ValueError naming the row's columns."""
    for col in ANSWER_COLUMNS:
        if col == "reward_model.ground_truth":
            rm = row.get("reward_model")
            value = rm.get("ground_truth") if isinstance(rm, dict) else None
        else:
            value = row.get(col)
        if value is not None:
            text = str(value)
            return (text.rsplit("####", 1)[1] if "####" in text else text).strip()
    raise ValueError(f"no reference answer: none of the columns {', '.join(ANSWER_COLUMNS)} is set "
                     f"(the row's columns: {sorted(row)})")


_import_lock = threading.Lock()
_math_verify: Future | None = None


def _load_math_verify():
    from math_verify import parse, verify
    import logging
    for name in ("math_verify.grader", "math_verify.parser"):   # their "timeout is disabled" notice: timeout_s bounds it
        logging.getLogger(name).setLevel(logging.ERROR)
    verify(parse("1", parsing_timeout=None), parse("1", parsing_timeout=None), timeout_seconds=None)  # its regexes, compiled here
    return parse, verify


def math_verify_import() -> Future:
    """The future of math-verify's ``(parse, verify)``, imported once per process on a daemon thread
    (started by the first call); its exception is an ImportError's ValueError."""
    global _math_verify
    with _import_lock:
        if _math_verify is None:
            _math_verify = fut = Future()

            def load():
                try:
                    fut.set_result(_load_math_verify())
                except BaseException as e:     # noqa: BLE001 — handed to whoever waits on it
                    fut.set_exception(ValueError(f"reward 'math' needs the math-verify package "
                                                 f"(pip install math-verify): {type(e).__name__}: {e}"))
            threading.Thread(target=load, name="arbor-import-math-verify", daemon=True).start()
    return _math_verify


def builtin(spec: str, length_target: int):
    """(function, one-line description, runs inline?) for the built-in ``spec``; ValueError for a bad
    regex or a missing math-verify. Inline functions are cheap enough to run on the event loop."""
    if spec == "math":
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError("reward 'math' needs the math-verify package (pip install math-verify): "
                             "No module named 'math_verify'")

        def math(prompt, completion, **row) -> float:
            parse, verify = math_verify_import().result()
            gold = parse(reference_answer(row), parsing_timeout=None)
            if not gold:
                raise ValueError(f"math-verify cannot parse the reference answer {reference_answer(row)!r}")
            return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))
        math.ready = math_verify_import
        return math, "math-verify of the completion against the row's answer, 1/0", False
    if spec == "exact":
        def exact(prompt, completion, **row) -> float:
            return float(completion.strip() == reference_answer(row))
        return exact, "completion.strip() == the row's answer, 1/0", True
    if spec == "length_penalty":
        def length_penalty(prompt, completion, **row) -> float:
            return -min(1.0, max(0, len(completion) - length_target) / length_target)
        return length_penalty, f"-min(1, max(0, len - {length_target}) / {length_target}), in characters", True
    pattern = spec.removeprefix("regex:")
    compiled = compile_regex(spec)

    def regex(prompt, completion, **row) -> float:
        return float(compiled.search(completion) is not None)
    return regex, f"1 if re.search({pattern!r}, completion) else 0", True


def compile_regex(spec: str) -> re.Pattern:
    pattern = spec.removeprefix("regex:")
    if not pattern:
        raise ValueError(f"reward {spec!r}: empty pattern (write regex:PATTERN)")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"reward {spec!r}: bad regular expression {pattern!r}: {e}") from e
