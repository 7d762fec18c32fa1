"""Arbor's AdamW (``arbor.train.adamw``) against ``torch.optim.AdamW``: the same weights bit for bit in
float64, states that load into each other, and no ``torch._dynamo`` import on the training path."""

import subprocess
import sys

import pytest
import torch

from arbor.train.adamw import AdamW, reference_step

LRS = (1e-2, 3e-2, 5e-3, 2e-2, 1e-2, 4e-3)          # a changing lr, as the schedule sets it before each step


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in ((7, 5), (5,), (3, 4, 2))]


def grads(step, ps):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps]


def run(opt, ps, lrs, start=0):
    for k, lr in enumerate(lrs, start):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(ps, grads(k, ps)):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


def two_groups(ps):
    return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.3}]


def test_weights_equal_torch_fused_adamw_bit_for_bit_in_float64():
    ours, theirs = params(), params()
    run(AdamW(two_groups(ours), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), ours, LRS)
    run(torch.optim.AdamW(two_groups(theirs), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True), theirs, LRS)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_reference_step_equals_the_fused_kernel_in_float64():
    """The non-CPU/CUDA path: same formula in plain ops. Float64 rounding of the two orders of evaluation
    differs by a few ulps per step (|p| ~ 1): 1e-12 is ~4000 ulps, far below one update (~1e-2)."""
    fused, ref = params(), params()
    run(AdamW(fused, lr=1e-2, weight_decay=0.1), fused, LRS)
    state = {}
    for k, lr in enumerate(LRS):
        for p, g in zip(ref, grads(k, ref)):
            m, v = state.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
            with torch.no_grad():
                reference_step(p, g, m, v, float(k + 1), lr, 0.9, 0.999, 0.1, 1e-8)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not torch.equal(fused[0], params()[0])


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_moves_between_torch_and_arbor(direction):
    """Three steps in one optimizer, its state_dict loaded into the other, three more steps: the weights
    equal six steps of one optimizer (bit for bit, float64)."""
    make_ours = lambda ps: AdamW(two_groups(ps), lr=1e-2, weight_decay=0.1)                          # noqa: E731
    make_torch = lambda ps: torch.optim.AdamW(two_groups(ps), lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
    first, second = (make_ours, make_torch) if direction == "ours_to_torch" else (make_torch, make_ours)
    straight = params()
    run(make_torch(straight), straight, LRS)
    moved = params()
    opt = first(moved)
    run(opt, moved, LRS[:3])
    state = opt.state_dict()
    opt = second(moved)
    opt.load_state_dict(state)
    run(opt, moved, LRS[3:], start=3)
    for a, b in zip(moved, straight):
        assert torch.equal(a, b)


def test_load_state_dict_of_another_parameter_set_is_refused():
    opt = AdamW(params(), lr=1e-2)
    with pytest.raises(ValueError, match="another set of trained parameters"):
        opt.load_state_dict(AdamW(params()[:2]).state_dict())


def test_training_step_does_not_import_torch_dynamo():
    """``torch.optim`` imports ``torch._dynamo`` (1.2–1.4 s) in its constructor and step; Arbor's
    optimizer path must not."""
    code = ("import sys, torch\n"
            "from arbor.train.optim import OptimConfig, make_optimizer, optimizer_step\n"
            "m = torch.nn.Linear(4, 3)\n"
            "m(torch.randn(2, 4)).sum().backward()\n"
            "optimizer_step(m, make_optimizer(m, OptimConfig()), 0, 10, OptimConfig())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
