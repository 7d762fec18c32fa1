"""AInfer-PD's hazard and its fix on 2 ranks (rank programs in tests/pd_cases.py, child processes):
crossed P/D exchanges on one group are caught by the tag check; private groups through an in-order
device queue deadlock without the turnstile (caught by the timeout); with the turnstile, stress
rounds with random skew run clean and equal the one-process model."""

import sys
import time

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


def test_the_distributed_engine_under_pd_policies_equals_one_process():
    result, text = run("engine", "pd-multiplex", "pd-global-enqueue")
    assert result.returncode == 0, text
    assert text.count("equal True") == 4, text
    assert "pd-global-enqueue" in text and " 0 boundaries" in text    # no boundaries in the coarse baseline
