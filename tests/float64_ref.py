"""Float64 references for the tests whose fast side has no float64 path (the engine, its C kernels).

The engine runs float32 or bfloat16 (its kernels and packed GEMMs have no float64 path), so such a test
cannot run both sides in float64 like the trainer-only equalities. Instead the fast side is compared with
the exact value (the same computation on a float64 copy, to float64 rounding), and the bound is FACTOR ×
the rounding error of a plain computation in the fast side's dtype (the trainer's log-probs, the PyTorch
op the kernel replaces, an engine run without the feature under test), measured on every run — so it
scales with the machine's own rounding and holds on any CPU. Measured on an AVX-512 Xeon, under AVX2 and
with ARBOR_CPU_KERNELS=0: the fast sides are 0.6 to 2.3 × that error off (engine vs trainer log-probs:
3.9e-7 to 5e-7 off, trainer noise 4.3e-7 to 5.4e-7).
"""

from __future__ import annotations

import copy

import torch

from arbor.train.logprobs import packed_logprobs

FACTOR = 10


def engine_gap(model, trajs, logprobs=None) -> tuple[float, float]:
    """→ (gap, bound) over the loss tokens of ``trajs``: gap = max |engine log-prob − the log-prob
    under a float64 copy of ``model``|, bound = FACTOR × max |``model``'s float32 log-prob − that
    float64 one|. ``logprobs(m)`` gives the flat log-probs of the trajectories' tokens under model m
    (default: packed, the model's own distribution)."""
    logprobs = logprobs or (lambda m: packed_logprobs(m, [t.tokens for t in trajs])[0])
    with torch.no_grad():
        exact = logprobs(copy.deepcopy(model).double())
        own = logprobs(model).double()
    assert exact.dtype == torch.float64
    mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.bool)
    infer = torch.tensor([x for t in trajs for x in t.logp_infer], dtype=torch.float64)
    noise = float((own - exact)[mask].abs().max())
    assert noise > 0, "float32 and float64 log-probs agree exactly: no noise to scale the bound by"
    return float((infer - exact)[mask].abs().max()), FACTOR * noise


def exact_logprobs(model64, prompt_ids, token_ids, spec=None) -> torch.Tensor:
    """log-probs [len(token_ids)] of ``token_ids`` generated after ``prompt_ids``, under ``model64`` (a
    float64 copy) in ``spec``'s distribution (``SamplingSpec``; None: the model's own)."""
    from arbor.models import VarlenAttention
    ids = list(prompt_ids) + list(token_ids)
    with torch.no_grad():
        logits = model64.logits(model64(torch.tensor(ids), VarlenAttention.from_lengths([len(ids)])).hidden)
    logp = spec.logprobs(logits) if spec is not None else logits.log_softmax(-1)
    return logp[len(prompt_ids) - 1:-1].gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def assert_within_engine_noise(got: list, ref: list, exact: list[torch.Tensor]) -> None:
    """Two engine runs of the same requests (``got``, ``ref``: per request log-prob lists): ``got`` within
    FACTOR × ``ref``'s own error of the float64 ``exact`` log-probs (of the weights the engines serve).
    Measured: float32 2e-7 to 3.3e-6, bfloat16 2e-3 to 5e-2; ``got`` ≤ 1.2 × that off."""
    err = lambda run: max(float((torch.tensor(a, dtype=torch.float64) - e).abs().max()) for a, e in zip(run, exact))
    noise, gap = err(ref), err(got)
    assert 0 < noise and gap <= FACTOR * noise, f"engine log-probs off by {gap:.3g} > {FACTOR} × {noise:.3g}"


def assert_near_exact(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, factor: float = FACTOR) -> None:
    """A fast path's result ``got`` is within ``factor`` × the rounding error of ``plain`` (the PyTorch
    computation it replaces, in the same dtype) of the ``exact`` float64 value: max-abs over all entries,
    with the plain path's error measured here on every run."""
    got, plain, exact = (t.detach().double() for t in (got, plain, exact))
    noise, gap = float((plain - exact).abs().max()), float((got - exact).abs().max())
    assert 0 < noise and gap <= factor * noise, f"off by {gap:.3g} > {factor} × {noise:.3g} (the plain path's error)"
