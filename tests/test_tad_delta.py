"""`arbor dllm-distill --mode quality` distils with the Quality Δ (2), not the Speed one (8)."""

from arbor.dllm.tad import QUALITY_DELTA, SPEED_DELTA, TADConfig, mode_delta


def test_each_mode_gets_its_delta_unless_one_is_given():
    assert TADConfig().delta is None
    assert mode_delta("quality") == QUALITY_DELTA == 2 and mode_delta("speed") == SPEED_DELTA == 8
    assert mode_delta("quality", 5) == 5 and mode_delta("speed", 3) == 3
