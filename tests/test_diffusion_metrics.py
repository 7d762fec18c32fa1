"""TPF and AUP exactly as specs/diffusion.md defines them, against hand-computed examples."""

import math

import pytest

from arbor.dllm.metrics import aup, aup_weight, tpf


def test_tpf_is_total_tokens_over_total_forwards():
    assert tpf([3, 5], [2, 2]) == 2.0
    assert tpf([16, 0], [4, 4]) == 2.0
    assert tpf([], []) == 0.0


def test_aup_worked_example_by_hand():
    # points (TPF, accuracy %); y_1 = 80 at the lowest TPF, so (3.0, 70) < 75 is dropped.
    # W(y) = min(exp(-3(1 - y/82)), 1): W(80) = 0.9294421, W(78) = 0.8638627, W(76) = 0.8029104
    # AUP = 1·80 + ½·(2-1)·(78·W(78) + 80·W(80)) + ½·(4-2)·(76·W(76) + 78·W(78))
    #     = 80 + ½·(67.38129 + 74.35537) + (61.02119 + 67.38129) = 279.27081
    points = [(4.0, 76.0), (1.0, 80.0), (3.0, 70.0), (2.0, 78.0)]
    assert aup(points, y_max=82.0) == pytest.approx(279.27081, abs=1e-4)   # the sum above, rounded to 5 decimals


def test_aup_single_point_at_one_is_the_accuracy_and_weights_cap_at_one():
    assert aup([(1.0, 63.9)]) == pytest.approx(63.9)
    assert aup_weight(90.0, 80.0) == 1.0
    assert aup_weight(40.0, 80.0) == pytest.approx(math.exp(-1.5))
    # y_max defaults to the best of the points: 50 → W = 1 everywhere; trapezoid 1·50 + ½·2·(50 + 50)
    assert aup([(1.0, 50.0), (3.0, 50.0)]) == pytest.approx(150.0)


def test_aup_needs_points():
    with pytest.raises(ValueError):
        aup([])
