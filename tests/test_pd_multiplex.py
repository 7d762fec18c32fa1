"""AInfer-PD's hazard and its fix on 2 ranks (rank programs in tests/pd_cases.py, child processes):
crossed P/D exchanges on one group are caught by the tag check; private groups through an in-order
device queue deadlock without the turnstile (caught by the timeout); with the turnstile, stress
rounds with random skew run clean and equal the one-process model. The engine's concurrent prefill
and decode workers (``pd_runtime``): with the turnstile they give the one-process engine's greedy
tokens; without it (the naive design) their collectives cross and the run fails in seconds."""

import re
import sys
import time

import pytest

from arbor.distributed.launch import launch


def run(*args, timeout=60, env=None):
    result = launch([sys.executable, "-m", "tests.pd_cases", *args], 2, threads=1, timeout_s=timeout, echo=None,
                    grace_s=5, env=env)
    return result, "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])


def test_one_shared_group_crossed_by_skewed_ranks_fails_the_tag_check():
    result, text = run("naive")
    assert result.codes == [3, 3], text
    assert "this rank is at (phase prefill, layer 0, step 1) but rank 1 sent (phase decode, layer 0, step 1)" in text


def test_private_groups_on_an_in_order_queue_deadlock_without_the_turnstile():
    t0 = time.monotonic()
    result, text = run("private_no_turnstile", env={"CASE_TIMEOUT": "3"}, timeout=40)
    assert 3 in result.codes, text
    assert "deadlock caught" in text and "no peer answered within 3 s" in text
    assert time.monotonic() - t0 < 30


def test_the_turnstile_orders_p_and_d_over_20_skewed_rounds():
    result, text = run("turnstile", "20")
    assert result.returncode == 0, text
    assert text.count("tokens equal True") == 2 and "20 boundaries" in text


def _counts(text: str, policy: str) -> list[tuple[int, int, int]]:
    """(steps, boundaries, D steps inside prefills) per rank from case_engine's lines."""
    found = re.findall(rf"{policy}: \d+ requests in (\d+) steps, (\d+) boundaries, \d+ decode steps, (\d+) inside", text)
    return [tuple(map(int, f)) for f in found]


@pytest.mark.parametrize("case", ["engine", "engine_own_queue"])
def test_concurrent_p_and_d_workers_on_2_ranks_equal_one_process(case):
    result, text = run(case, "pd-multiplex", "pd-global-enqueue")
    assert result.returncode == 0, text
    assert text.count("equal True") == 4, text
    fine, coarse = _counts(text, "pd-multiplex"), _counts(text, "pd-global-enqueue")
    assert len(fine) == len(coarse) == 2, text
    assert all(inside > 0 and bounds > steps for steps, bounds, inside in fine), text    # D steps inside prefills
    assert all(inside == 0 and bounds == steps for steps, bounds, inside in coarse), text  # one boundary per step


def test_the_naive_concurrent_design_crosses_collectives_and_fails():
    """P and D workers per rank with private groups on the in-order queue, no turnstile: a rank's D
    step meets no peer (or the peer's P) and the run fails within the group timeout."""
    t0 = time.monotonic()
    result, text = run("engine_naive", "pd-multiplex", env={"CASE_TIMEOUT": "3"}, timeout=40)
    assert 3 in result.codes, text
    assert "crossed P/D collectives" in text and any(                       # gloo words a crossing's timeout
        why in text for why in ("no peer answered within 3 s", "TagMismatch", "Timed out waiting")), text  # several ways
    assert time.monotonic() - t0 < 35
