"""``arbor bench e2e``'s pure parts: time to accuracy, the summary and its targets, the settings both systems
share (Arbor's config and TRL's GRPOConfig), the training clock, and what TRL needs of an Arbor model folder
(its prompts rendered to Arbor's ids, its tool calls parsed by transformers)."""

import json
import time
from pathlib import Path

import pytest

from arbor import configs
from arbor.bench.e2e import (EXAMPLE, Settings, arbor_overrides, final_at, learned, median_time, summarize, time_to,
                             trl_config)
from arbor.bench.e2e_worker import TrainClock
from arbor.bench.rl_trl import last_answer
from arbor.train.config import RLConfig


def test_time_to_first_reach():
    curve = [(0.0, 0.2), (10.0, 0.5), (20.0, 0.7), (30.0, 0.6), (40.0, 0.8)]
    assert time_to(curve, 0.7) == 20.0
    assert time_to(curve, 0.2) == 0.0
    assert time_to(curve, 0.75) == 40.0
    assert time_to(curve, 0.81) is None
    assert time_to(list(reversed(curve)), 0.7) == 20.0          # by time, not by list order


def test_median_time_counts_never_as_the_limit():
    assert median_time([10.0, None, 30.0], 100.0) == (30.0, False)
    assert median_time([10.0, None, None], 100.0) == (100.0, True)
    assert median_time([5.0, 7.0, 9.0], 100.0) == (7.0, False)
    assert median_time([10.0, None], 100.0) == (55.0, True)       # half never: the median leans on the limit


def run(*points):
    return {"curve": [(0.0, 0.3), *points]}


def test_summary_ratio_and_targets():
    runs = {"arbor": [run((10.0, 0.5), (20.0, 0.8)), run((10.0, 0.7), (20.0, 0.75)), run((10.0, 0.4), (20.0, 0.9))],
            "trl": [run((40.0, 0.75), (80.0, 0.7)), run((30.0, 0.6), (80.0, 0.73)), run((60.0, 0.73), (80.0, 0.8))]}
    s, targets = summarize(runs, 100.0, 0.5, "plain")
    assert s["better_final"] == 0.8 and s["threshold"] == pytest.approx(0.72, rel=1e-15)
    assert s["arbor"]["time_to_threshold_s"] == [20.0, 20.0, 20.0]
    assert s["trl"]["time_to_threshold_s"] == [40.0, 80.0, 60.0]
    assert s["ratio"] == pytest.approx(20.0 / 60.0, rel=1e-15) and not s["ratio_is_upper_bound"]
    assert [t["met"] for t in targets] == [True, True]
    assert targets[1]["value"] == 0.8 and targets[1]["target"] == ">= 0.7"


def test_no_ratio_when_the_threshold_is_within_evaluation_noise():
    assert learned(0.24, 0.88, 100) and not learned(0.01, 0.018, 100) and not learned(0.5, 0.55, 100)
    assert learned(0.5, 0.62, 100) and not learned(0.5, 0.58, 100)         # 2·√(p(1−p)/n) = 0.097 / 0.099 at n = 100
    noisy = {"arbor": [{"curve": [(0.0, 0.01), (5.0, 0.03), (9.0, 0.0)]}] * 3,
             "trl": [{"curve": [(0.0, 0.01), (8.0, 0.02), (9.0, 0.02)]}] * 3}
    s, targets = summarize(noisy, 10.0, 0.5, "plain", rows=100)
    assert s["arbor"]["median_time_s"] == 5.0 and s["trl"]["median_time_s"] == 8.0    # noise crosses 0.018 …
    assert s["ratio"] is None and "noise" in s["note"] and not targets[0]["met"]     # … and is not timed
    s, _ = summarize(noisy, 10.0, 0.5, "plain", rows=100_000)       # the same gap on 100 000 rows is learning
    assert s["ratio"] == pytest.approx(5.0 / 8.0, rel=1e-15)


def test_where_the_time_went():
    def timed(ends, saves, curve):
        return {"step_end_s": ends, "snapshots": [{"step": n, "train_s": t} for n, t in saves], "curve": curve}
    runs = {"arbor": [timed([3.0, 3.5, 4.5, 5.0], [(2, 3.5), (4, 5.0)], [(0.0, 0.3), (3.5, 0.5), (5.0, 0.9)]),
                      timed([2.0, 3.0, 4.0], [(3, 4.0)], [(0.0, 0.3), (4.0, 0.95)]),
                      timed([4.0, 4.25, 4.5], [(3, 4.5)], [(0.0, 0.3), (4.5, 0.4)])],
            "trl": [run((9.0, 0.9))] * 3}                       # no step times: nothing added
    s, _ = summarize(runs, 10.0, 0.5, "tool")
    assert s["arbor"]["steps_to_threshold"] == [4, 3, None] and s["arbor"]["first_step_end_s"] == 3.0
    assert s["arbor"]["step_s"] == 0.5 and "step_s" not in s["trl"]        # medians 0.5, 1.0, 0.25


def test_summary_when_trl_never_gets_there():
    runs = {"arbor": [run((10.0, 0.9))] * 3, "trl": [run((50.0, 0.4))] * 2 + [run((50.0, 0.85))]}
    s, targets = summarize(runs, 100.0, 0.33, "tool")
    assert s["trl"]["median_time_s"] == 100.0 and s["ratio_is_upper_bound"]
    assert s["ratio"] == pytest.approx(0.1, rel=1e-15) and targets[0]["met"]
    runs["arbor"] = [run((10.0, 0.3))] * 3                  # Arbor worse than TRL's lowest seed: not met
    s, targets = summarize(runs, 100.0, 0.33, "tool")
    assert s["ratio"] is None and [t["met"] for t in targets] == [False, False]
    flat = {"arbor": [run((10.0, 0.3))] * 3, "trl": [run((10.0, 0.31))] * 3}   # nothing learned: t = 0 reaches it
    s, targets = summarize(flat, 100.0, 0.5, "plain")
    assert s["trl"]["median_time_s"] == 0.0 and s["ratio"] is None and "note" in s and not targets[0]["met"]


def test_trl_timed_past_the_horizon_with_finals_read_at_it():
    """TRL trains to twice the horizon (100 s): its finals are its accuracy saved at the horizon, and a
    crossing after the horizon is a time, not a censored one."""
    assert final_at([(0.0, 0.3), (90.0, 0.5), (100.5, 0.6), (150.0, 0.9)], 100.0) == 0.6
    assert final_at([(0.0, 0.3), (90.0, 0.5)], 100.0) == 0.5          # a run that ended early: its last
    runs = {"arbor": [run((30.0, 0.85), (100.2, 0.9))] * 3,
            "trl": [run((100.4, 0.7), (150.0, 0.82)), run((100.1, 0.75), (190.0, 0.81)),
                    run((100.3, 0.8), (200.2, 0.8))]}
    s, targets = summarize(runs, 100.0, 0.33, "tool", limits={"trl": 200.0})
    assert s["trl"]["final"] == [0.7, 0.75, 0.8] and s["better_final"] == 0.9      # the 0.82 at 150 s is not a final
    assert s["trl"]["time_to_threshold_s"] == [150.0, 190.0, None] and not s["trl"]["median_censored"]
    assert s["ratio"] == pytest.approx(30.0 / 190.0, rel=1e-15) and not s["ratio_is_upper_bound"] and targets[0]["met"]
    runs["trl"][1] = run((100.1, 0.75), (190.0, 0.8))
    s, _ = summarize(runs, 100.0, 0.33, "tool", limits={"trl": 200.0})
    assert s["trl"]["median_censored"] and s["trl"]["median_time_s"] == 200.0 and s["ratio_is_upper_bound"]


@pytest.mark.parametrize("variant", ["plain", "tool"])
def test_both_systems_get_the_same_settings(tmp_path, variant):
    s = Settings()
    cfg = configs.load(RLConfig, None, arbor_overrides(s, variant, tmp_path, tmp_path / "m", tmp_path / "o", 3, 50))
    cfg.validate()
    trl = trl_config(s, variant)
    assert cfg.groups_per_step * cfg.rollout.branch[0] == trl["per_device_train_batch_size"] == s.samples_per_step
    assert cfg.rollout.branch == [trl["num_generations"]] and not cfg.c3po.enabled
    assert cfg.rollout.temperature == trl["temperature"] and cfg.rollout.top_p == trl["top_p"] and trl["top_k"] == 0
    assert cfg.optim.lr == trl["learning_rate"] and cfg.optim.warmup_steps == trl["warmup_steps"]
    assert cfg.optim.min_lr_ratio == 1.0 and trl["lr_scheduler_type"] == "constant_with_warmup"
    assert tuple(cfg.optim.betas) == (trl["adam_beta1"], trl["adam_beta2"]) and cfg.optim.grad_clip == trl["max_grad_norm"]
    assert cfg.optim.weight_decay == trl["weight_decay"] and cfg.loss.kl_coef == trl["beta"] == 0.0
    assert cfg.ppo_epochs == trl["num_iterations"] == 1 and cfg.seed == cfg.rollout.seed == 3
    turns = cfg.rollout.max_turns if variant == "tool" else 1
    assert trl["max_completion_length"] == turns * cfg.rollout.max_turn_tokens
    assert bool(cfg.tools) == (variant == "tool") == ("max_tool_calling_iterations" in trl)
    if variant == "tool":
        assert trl["max_tool_calling_iterations"] == cfg.rollout.max_turns - 1
    trl_mod = pytest.importorskip("trl")
    g = trl_mod.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], **trl)   # TRL takes every key
    assert g.generation_batch_size == s.samples_per_step and g.steps_per_generation == 1
    assert g.loss_type == "dapo" and cfg.loss.agg == "token"     # both: the mean over the batch's trained tokens


def test_clock_leaves_saves_out(tmp_path):
    clock = TrainClock(tmp_path, seconds=10.0, every_s=0.05)
    assert not clock.due()
    time.sleep(0.06)
    assert clock.due()
    before = clock.now()
    clock.snapshot(3, lambda path: (path.mkdir(), time.sleep(0.3)))
    assert clock.now() - before < 0.1                        # the 0.3 s save is not on the clock
    assert not clock.due() and before + 0.05 <= clock.next_save < before + 0.06   # growth 0: every_s after the save
    saves = json.loads((tmp_path / "snapshots.json").read_text())
    assert saves == clock.saves and saves[0]["step"] == 3 and Path(saves[0]["path"]).is_dir()


def saves_at(clock: TrainClock, step_ends) -> list[tuple[float, float]]:
    """(step end, next save time) for each step end at which ``clock`` saved."""
    grid = []
    for t in step_ends:
        clock.now = lambda t=t: t               # the clock read at each step end
        if clock.due():
            clock.snapshot(0, lambda path: None)
            grid.append((t, round(clock.next_save, 9)))
    return grid


def test_clock_gaps_grow_with_the_clock(tmp_path):
    """After a save at t the next is due at max(t + every_s, t · (1 + growth)): at least every_s apart,
    then a fixed fraction of the clock (a slow step simply ends past the due time)."""
    clock = TrainClock(tmp_path, seconds=100.0, every_s=0.5, start=0.0, growth=0.1)
    assert saves_at(clock, (0.2, 0.6, 1.0, 1.2, 4.0, 4.3, 4.5, 30.0, 32.0, 33.0)) == \
        [(0.6, 1.1), (1.2, 1.7), (4.0, 4.5), (4.5, 5.0), (30.0, 33.0), (33.0, 36.3)]
    marked = TrainClock(tmp_path, seconds=100.0, every_s=0.5, start=0.0, growth=0.1, mark=31.0)
    assert saves_at(marked, (0.6, 29.0, 30.5, 31.2, 34.0, 34.5)) == \
        [(0.6, 1.1), (29.0, 31.0), (31.2, 34.32), (34.5, 37.95)]     # 29 → the mark, not 31.9


def test_reward_reads_the_last_assistant_message():
    convo = [{"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "tool", "content": "56"},
             {"role": "assistant", "content": "Answer: 56"}]
    assert last_answer(convo) == "Answer: 56" and last_answer("Answer: 7") == "Answer: 7"
    assert last_answer(convo[:2]) == "" and last_answer([]) == ""


def test_an_arbor_folder_serves_trl(tmp_path):
    """TRL renders prompts with transformers' tokenizer of the folder and parses tool calls with its
    ``response_template``: the ids must be Arbor's, and a call in Arbor's format must parse."""
    transformers = pytest.importorskip("transformers")
    from arbor.data.objects import load_object
    from arbor.data.tools import tool_from_function
    from arbor.models.tokenizer import builtin_tokenizer
    ours = builtin_tokenizer()
    ours.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    calc = load_object(f"{EXAMPLE / 'tools.py'}:calc", "tools")
    msgs = [{"role": "user", "content": "Kim has 12 pens. Kim gets 5 more. How many pens does Kim have now?"}]
    ids = hf.apply_chat_template(msgs, tools=[calc], add_generation_prompt=True, tokenize=True, return_dict=False)
    schema = [tool_from_function(calc).schema]
    assert ids == ours.apply_chat_template(msgs, tools=schema, add_generation_prompt=True)
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "12+5"}}}
    turn = ours.apply_chat_template([*msgs, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=schema)
    assert turn[:len(ids)] == ids
    turn = turn[len(ids):]
    assert hf.parse_response(turn, prefix=ids)["tool_calls"] == [call]
    answer = ours.encode("Answer: 17<|im_end|>")
    assert hf.parse_response(answer, prefix=ids) == {"role": "assistant", "content": "Answer: 17"}
