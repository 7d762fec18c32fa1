"""Users' reward functions: ``RewardConfig`` names them, ``Rewards`` loads and calls them.

A spec in ``RewardConfig.fns`` is a built-in (``math``, ``exact``, ``regex:PATTERN``,
``length_penalty``; see ``reward_builtins``) or ``"path/to/file.py:name"`` / ``"pkg.module:name"``
(``objects.load_callable``). A user's function is taken in the form its parameter names show:

- Arbor: ``f(prompt, completion, **row) -> float``, one sample per call. ``prompt`` is the row's
  prompt (a string or chat messages), ``completion`` the final answer text; the row's other columns
  arrive as keywords (all of them with ``**row``, else those the function names).
- TRL: ``f(prompts, completions, **kwargs) -> list[float | None]``, one call per batch; the row's
  other columns arrive as lists. A completion is a string, or ``[{"role": "assistant", "content":
  …}]`` when its prompt is a list of messages (TRL's conversational form). ``None`` means "not
  applicable": that value is left out of the sample's sum and of the function's mean.
- verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
  with the row's ``data_source`` (or ``""``), ``reward_model.ground_truth`` (else a ``ground_truth``
  column) and ``extra_info`` (or None). A dict carries ``score`` plus numbers logged as
  ``reward/<name>/<key>`` means.

Markers: ``completion`` → Arbor, ``completions`` → TRL, ``solution_str`` → verl; parameters of two
forms (``prompt`` with ``completions``, …) or of none are a ValueError showing the three forms.
Any function may be ``async``; sync ones run in a worker thread (``asyncio.to_thread``). Every call
is bounded by ``timeout_s`` (a TRL call is one call for its whole batch; a built-in's ``ready()``, its
package's background import, is awaited before the clock starts); a timed-out thread cannot
be killed and runs on in the background, and an ``async`` function that blocks the event loop
cannot be interrupted.

A sample's reward is ``Σ_f w_f · r_f`` over the functions that returned a number for it (0.0 when
none did). An *error* is an exception, a timeout, or a value that is not a finite number (``None``
too, except from a TRL function): counted per sample, logged with the function, row index, row
and cause (the first ``LOGGED_PER_DRAIN`` per function between drains at WARNING, the rest at
DEBUG), and then either counted as 0 (``on_error="zero"``) or raised as ``RewardError``
(``"fail"``). ``drain()`` returns ``reward/<name>`` (the mean of the values a function returned,
errors and ``None`` left out), the verl extras and ``reward_errors``, and resets them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from arbor.configs import check
from arbor.data import reward_builtins
from arbor.data.objects import load_callable

log = logging.getLogger(__name__)

ON_ERROR = ("zero", "fail")
LOGGED_PER_DRAIN = 5
FORMS = ("the accepted forms:\n"
         "  Arbor: f(prompt, completion, **row) -> float                  (one sample per call; sync or async)\n"
         "  TRL:   f(prompts, completions, **kwargs) -> list[float | None]  (batched; sync or async)\n"
         "  verl:  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict")
MARKERS = {"Arbor": {"prompt", "completion"}, "TRL": {"prompts", "completions"}, "verl": {"solution_str"}}
PRIMARY = {"Arbor": "completion", "TRL": "completions", "verl": "solution_str"}
PASSED = {"Arbor": {"prompt", "completion"}, "TRL": {"prompts", "completions"},
          "verl": {"data_source", "solution_str", "ground_truth", "extra_info"}}


@dataclass
class RewardConfig:
    fns: list[str] = field(default_factory=list)        # built-in (math, exact, regex:PATTERN, length_penalty) or file.py:name / pkg.module:name
    weights: list[float] = field(default_factory=list)  # one per fn (empty: 1.0 each); reward = Σ weight · value
    timeout_s: float = 10.0                             # bound on each call (a TRL function's: per batch)
    on_error: str = "zero"                              # zero: a failed value counts 0 (counted, logged) | fail: raise RewardError
    length_target: int = 1024                           # length_penalty: 0 up to this many characters, -1 at twice it

    def validate(self) -> None:
        check(self, (all(isinstance(s, str) and s.strip() for s in self.fns), "fns", "must be non-empty strings"),
              (len(self.weights) in (0, len(self.fns)), "weights",
               f"must be empty (1.0 each) or one per fn ({len(self.fns)})"),
              (all(math.isfinite(w) for w in self.weights), "weights", "must be finite"),
              (self.timeout_s > 0, "timeout_s", "must be > 0"),
              (self.on_error in ON_ERROR, "on_error", f"must be one of {ON_ERROR}"),
              (self.length_target >= 1, "length_target", "must be ≥ 1"))
        for spec in self.fns:
            if spec.startswith("regex:"):
                reward_builtins.compile_regex(spec)
            elif not reward_builtins.is_builtin(spec) and ":" not in spec:
                raise ValueError(f"fns: {spec!r} is neither a built-in ({', '.join(reward_builtins.NAMES)}) "
                                 f"nor 'path/to/file.py:name' / 'pkg.module:name'")


class RewardError(ValueError):
    """A reward function failed under ``on_error="fail"``: names the function, row index and cause."""


class _Bad(Exception):
    """A cause stated as it is (not as 'TypeName: message')."""


@dataclass
class _Fn:
    spec: str
    name: str                # metric name: reward/<name>
    fn: object
    form: str                # Arbor | TRL | verl
    weight: float
    is_async: bool
    inline: bool             # a cheap built-in: called on the event loop
    named: frozenset         # parameters that can be passed by keyword
    var_kw: bool             # has **kwargs
    text: str                # for describe()

    def takes(self, key: str) -> bool:
        return self.var_kw or key in self.named


def detect_form(fn, spec: str) -> tuple[str, frozenset, bool]:
    """(form, keyword-passable parameter names, has **kwargs) from ``fn``'s signature (module
    docstring), or ValueError naming ``spec`` and showing the three forms."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {spec!r}: cannot read its signature ({e}); {FORMS}") from None
    P = inspect.Parameter
    named = frozenset(p.name for p in sig.parameters.values() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY))
    var_kw = any(p.kind is P.VAR_KEYWORD for p in sig.parameters.values())
    found = [form for form, marks in MARKERS.items() if marks & named]
    where = f"reward {spec!r} has parameters {sig}"
    if len(found) != 1 or PRIMARY[found[0]] not in named:
        why = f"names of the {' and '.join(found)} forms" if len(found) > 1 else "it matches none of them"
        raise ValueError(f"{where}: {why}; {FORMS}")
    form = found[0]
    required = [p.name for p in sig.parameters.values()
                if p.default is P.empty and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    if form == "verl":
        unknown = [n for n in required if n not in PASSED["verl"]]
    else:      # row columns may fill the others; these never come
        unknown = [n for n in required if n in ("completion_ids", "trainer_state")]
    positional = [p.name for p in sig.parameters.values() if p.kind is P.POSITIONAL_ONLY and p.default is P.empty]
    if unknown or positional:
        raise ValueError(f"{where}: Arbor cannot pass {unknown + positional} to a {form}-form function "
                         f"(it passes keywords: {sorted(PASSED[form])}"
                         f"{' and the row columns' if form != 'verl' else ''}); {FORMS}")
    return form, named, var_kw


def _number(value) -> float:
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise _Bad(f"returned {_short(value)} ({type(value).__name__}), not a number")
    out = float(value)
    if not math.isfinite(out):
        raise _Bad(f"returned {out}")
    return out


def _short(obj, n: int = 160) -> str:
    text = repr(obj)
    return text if len(text) <= n else text[:n - 1] + "…"


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _metric_name(spec: str, taken: set) -> str:
    if reward_builtins.is_builtin(spec):
        base = spec.split(":")[0]
    else:
        where, fn = spec.rsplit(":", 1)
        base = f"{Path(where).stem if where.endswith('.py') else where.rsplit('.', 1)[-1]}.{fn}"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


class Rewards:
    """The reward functions of a ``RewardConfig``, loaded (ValueError naming the spec on any load
    problem) and called as the module docstring says. ``score``/``score_batch`` may run
    concurrently from many tasks of one event loop."""

    def __init__(self, cfg: RewardConfig):
        cfg.validate()
        self.cfg, self.fns, taken = cfg, [], set()
        weights = cfg.weights or [1.0] * len(cfg.fns)
        for spec, weight in zip(cfg.fns, weights):
            if reward_builtins.is_builtin(spec):
                fn, what, inline = reward_builtins.builtin(spec, cfg.length_target)
                form, named, var_kw, text = "Arbor", frozenset(("prompt", "completion")), True, f"built-in: {what}"
            else:
                fn, inline = load_callable(spec, "reward.fns"), False
                form, named, var_kw = detect_form(fn, spec)
                text = f"{form} form {getattr(fn, '__name__', 'f')}{inspect.signature(fn)}"
            is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
            name = _metric_name(spec, taken)
            text += (", batched" if form == "TRL" else ", per sample") + (", async" if is_async else "")
            self.fns.append(_Fn(spec, name, fn, form, float(weight), is_async, inline, named, var_kw, text))
        self._values, self._extras = defaultdict(list), defaultdict(list)
        self._errors, self._logged = Counter(), Counter()
        for line in self.describe():
            log.info(line)

    def describe(self) -> list[str]:
        """One line per function: its spec, the form chosen, weight and metric name."""
        if not self.fns:
            return ["reward: no functions (every reward is 0.0)"]
        return [f"reward {f.spec!r}: {f.text}; weight {f.weight:g}; logged as reward/{f.name}" for f in self.fns]

    async def score(self, prompt, completion: str, row: dict, index: int | None = None) -> float:
        """The weighted reward of one sample (``score_batch`` of one)."""
        return (await self.score_batch([(prompt, completion, row, index)]))[0]

    async def score_batch(self, items) -> list[float]:
        """Rewards of ``items`` = [(prompt, completion, row, index)], in order; each TRL-form function
        is called once for the batch, every other function once per item, all concurrently."""
        items = [(p, c, dict(r or {}), i) for p, c, r, i in items]
        if not items:
            return []
        jobs = [self._batch(f, items) if f.form == "TRL" else self._each(f, items) for f in self.fns]
        per_fn = await asyncio.gather(*jobs)
        first_error = None
        totals = [0.0] * len(items)
        for f, outcomes in zip(self.fns, per_fn):
            for k, out in enumerate(outcomes):
                if isinstance(out, float):
                    totals[k] += f.weight * out
                    self._values[f.name].append(out)
                elif isinstance(out, _Bad):
                    first_error = first_error or (f, k, out)
        if first_error and self.cfg.on_error == "fail":
            f, k, cause = first_error
            raise RewardError(f"reward {f.name!r} ({f.spec}) failed on row {items[k][3]}: {cause}; "
                              f"row: {_short(items[k][2])}")
        return totals

    async def _each(self, f: _Fn, items) -> list:
        return list(await asyncio.gather(*(self._one(f, it) for it in items)))

    async def _one(self, f: _Fn, item):
        prompt, completion, row, index = item
        try:
            if f.form == "verl":
                rm = row.get("reward_model")
                if isinstance(rm, dict) and "ground_truth" in rm:
                    truth = rm["ground_truth"]
                elif "ground_truth" in row:
                    truth = row["ground_truth"]
                else:
                    raise _Bad(f"no ground truth: the row has neither reward_model.ground_truth nor a "
                               f"ground_truth column (its columns: {sorted(row)})")
                given = {"data_source": row.get("data_source") or "", "solution_str": completion,
                         "ground_truth": truth, "extra_info": row.get("extra_info")}
                kwargs = {k: v for k, v in given.items() if f.takes(k)}
            else:
                kwargs = {k: v for k, v in row.items() if k not in ("prompt", "completion") and f.takes(k)}
                kwargs.update((k, v) for k, v in (("prompt", prompt), ("completion", completion)) if f.takes(k))
            value = await self._call(f, kwargs)
            if f.form == "verl" and isinstance(value, dict):
                if "score" not in value:
                    raise _Bad(f"returned a dict without 'score': {_short(value)}")
                score = _number(value["score"])
                for key, extra in value.items():
                    if key != "score" and isinstance(extra, numbers.Real) and math.isfinite(extra):
                        self._extras[f"reward/{f.name}/{key}"].append(float(extra))
                return score
            return _number(value)
        except Exception as e:
            return self._error(f, [item], e)[0]

    async def _batch(self, f: _Fn, items) -> list:
        kwargs = {"prompts": [it[0] for it in items],
                  "completions": [[{"role": "assistant", "content": c}] if _is_chat(p) else c for p, c, _, _ in items]}
        kwargs = {k: v for k, v in kwargs.items() if f.takes(k)}
        columns = dict.fromkeys(k for it in items for k in it[2])
        for col in columns:
            if col not in ("prompt", "completion", "prompts", "completions") and f.takes(col):
                kwargs[col] = [it[2].get(col) for it in items]
        try:
            values = await self._call(f, kwargs)
            values = values.tolist() if hasattr(values, "tolist") else values
            if not isinstance(values, (list, tuple)):
                raise _Bad(f"returned {_short(values)} ({type(values).__name__}), not a list")
            if len(values) != len(items):
                raise _Bad(f"returned {len(values)} values for {len(items)} completions")
        except Exception as e:
            return self._error(f, items, e)
        out = []
        for it, v in zip(items, values):
            try:
                out.append(None if v is None else _number(v))
            except Exception as e:
                out += self._error(f, [it], e)
        return out

    async def _call(self, f: _Fn, kwargs: dict):
        if f.inline:
            return f.fn(**kwargs)

        async def run():
            out = f.fn(**kwargs) if f.is_async else await asyncio.to_thread(f.fn, **kwargs)
            return await out if inspect.isawaitable(out) else out
        ready = getattr(f.fn, "ready", None)     # a built-in's import in the background: not the call's time
        if ready is not None and not (fut := ready()).done():
            await asyncio.wrap_future(fut)
        start = time.monotonic()
        try:
            return await asyncio.wait_for(run(), self.cfg.timeout_s)
        except TimeoutError:
            if time.monotonic() - start < self.cfg.timeout_s:
                raise          # the function's own TimeoutError
            raise _Bad(f"timed out after {self.cfg.timeout_s:g} s (timeout_s)") from None

    def _error(self, f: _Fn, items, e: Exception) -> list[_Bad]:
        """Count and log the error of ``f`` on ``items``; one ``_Bad`` (the cause) per item."""
        cause = str(e) if isinstance(e, _Bad) else f"{type(e).__name__}: {e}"
        if "signal only works in main thread" in cause or "threaded environment" in cause:
            cause += (" (sync rewards run in a worker thread: turn the library's own signal timeout off, e.g. "
                      "math_verify parse(..., parsing_timeout=None); Arbor's timeout_s bounds the call)")
        self._errors[f.name] += len(items)
        rows = items[0][3] if len(items) == 1 else [it[3] for it in items]
        level = logging.WARNING if self._logged[f.name] < LOGGED_PER_DRAIN else logging.DEBUG
        self._logged[f.name] += 1
        log.log(level, "reward %r (%s) failed on row %s: %s; row: %s", f.name, f.spec,
                "?" if rows is None else rows, cause, _short(items[0][2]))
        return [_Bad(cause)] * len(items)

    def drain(self) -> dict:
        """Metrics since the last drain (module docstring); warns when there were errors."""
        out = {f"reward/{name}": sum(v) / len(v) for name, v in self._values.items() if v}
        out |= {key: sum(v) / len(v) for key, v in self._extras.items() if v}
        out["reward_errors"] = sum(self._errors.values())
        if out["reward_errors"]:
            hidden = sum(max(0, n - LOGGED_PER_DRAIN) for n in self._logged.values())
            log.warning("reward errors since the last step: %d (%s)%s; each counted as %s", out["reward_errors"],
                        ", ".join(f"{n}: {c}" for n, c in self._errors.items()),
                        f"; {hidden} log lines at DEBUG level" if hidden else "",
                        "0" if self.cfg.on_error == "zero" else "a failure")
        self._values, self._extras = defaultdict(list), defaultdict(list)
        self._errors, self._logged = Counter(), Counter()
        return out
