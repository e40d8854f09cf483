"""HeadKLLoss against the loss written in PyTorch float64 (tests/reference.py):
the loss and ``hidden.grad``, for every option, on every backend."""

import pytest
import torch

import headkl.torch as ht
from reference import reference

V, HS, K = 300, 40, 8  # V and hs off the 16-wide tiles


def problem(seed, lead=(3, 7), k=K, form="probs"):
    """Exact small-integer head and hidden rows (f16 holds them exactly), a
    teacher top-k with distinct ids, labels with an ignored and a negative one."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-8, 9, (V, HS), generator=g).float() / 32
    hidden = torch.randint(-8, 9, lead + (HS,), generator=g).float() / 16
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(hidden[..., 0].numel())]).reshape(lead + (k,))
    probs = torch.rand(lead + (k,), generator=g) + 0.05
    probs = probs / probs.sum(-1, keepdim=True) * 0.9  # a tail of 0.1 for bucket and none
    values = probs.log() if form == "logprobs" else probs
    labels = torch.randint(0, V, lead, generator=g)
    labels.view(-1)[0] = -100
    labels.view(-1)[1] = -7
    weights = torch.rand(lead, generator=g) + 0.5
    weights.view(-1)[2] = 0.0
    return weight, hidden, ids, values, labels, weights


CASES = {
    "default": {},
    "temperature-weights": dict(temperature=2.0, _weights=True),
    "sum": dict(reduction="sum"),
    "batchmean": dict(reduction="batchmean", _weights=True),
    "none": dict(reduction="none", _weights=True),
    "total": dict(_weights=True, _total=11.5),
    "bucket": dict(tail="bucket"),
    "tail-none": dict(tail="none"),
    "logprobs": dict(teacher_form="logprobs"),
    "teacher-temperature": dict(teacher_temperature=2.0, temperature=1.5),
    "reverse": dict(divergence="reverse"),
    "reverse-bucket": dict(divergence="reverse", tail="bucket"),
    "jsd": dict(divergence="jsd", beta=0.3),
    "hard-smoothing": dict(weight_hard_loss=0.7, weight_soft_loss=0.5, label_smoothing=0.1, _labels=True),
    "zloss-softcap-scale": dict(lse_square_scale=0.01, softcap=3.0, logit_scale=1.5),
    "ignore-mask": dict(ignore_mask=True, _labels=True, _weights=True),
    "ignore-index": dict(weight_hard_loss=1.0, ignore_index=5, _labels=True),
}


def case_problem(case):
    """CASES[case]'s loss options and problem: ``(opts, (weight, hidden,
    ids, values), call)``, ``call`` the forward's labels, weights and
    total."""
    opts = dict(CASES[case])
    use_labels, use_weights, total = opts.pop("_labels", False), opts.pop("_weights", False), opts.pop("_total", None)
    weight, hidden, ids, values, labels, weights = problem(7, form=opts.get("teacher_form", "probs"))
    if opts.get("ignore_index", -100) != -100:
        labels.view(-1)[3] = opts["ignore_index"]
    call = dict(labels=labels if use_labels else None, weights=weights if use_weights else None, total=total)
    return opts, (weight, hidden, ids, values), call


def close(got, want, what, rel=2e-3):
    scale = want.abs().max().item() + 1e-6
    err = (got.double() - want).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3e} against scale {scale:.3e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradient_match_torch_f64(backend, case):
    opts, (weight, hidden, ids, values), call = case_problem(case)
    want_loss, want_dx = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K),
                                   **{k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in call.items()},
                                   **opts)  # fmt: skip
    loss_fn = ht.HeadKLLoss(weight, backend=backend, **opts)
    x = hidden.clone().requires_grad_()
    loss = loss_fn(x, ids, values, **call)
    assert loss.shape == (hidden.shape[:-1] if opts.get("reduction") == "none" else ())
    # A gradient of ones for "none"; for the others a scale of 3 checks that
    # backward multiplies by the incoming gradient.
    upstream = 1.0 if opts.get("reduction") == "none" else 3.0
    (loss.sum() * upstream).backward()
    close(loss.reshape(-1), want_loss.reshape(-1), "loss", rel=1e-4)
    close(x.grad.reshape(-1, HS), want_dx * upstream, "dx")
    assert x.grad.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_hidden_rows_and_head(backend, dtype):
    weight, hidden, ids, values, _, _ = problem(3)
    want_loss, want_dx = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K))
    x = hidden.to(dtype).requires_grad_()
    loss = ht.HeadKLLoss(weight.to(dtype), backend=backend)(x, ids, values)
    loss.backward()
    assert x.grad.dtype == dtype
    close(loss.reshape(1), want_loss.reshape(1), "loss", rel=1e-4)
    close(x.grad.float().reshape(-1, HS), want_dx, "dx", rel=1e-2)


def test_gradient_flows_into_a_model(backend):
    """The loss inside a module graph: the gradient reaches the parameters
    before the hidden rows, as autograd composes it."""
    weight, _, ids, values, _, _ = problem(11, lead=(16,))
    torch.manual_seed(0)
    proj = torch.nn.Linear(12, HS).double()
    inputs = torch.randn(16, 12, dtype=torch.float64)
    loss_fn = ht.HeadKLLoss(weight, backend=backend)
    hidden = proj(inputs).float()
    loss_fn(hidden, ids, values).backward()
    got = proj.weight.grad.clone()
    proj.zero_grad()
    hidden = proj(inputs)
    _, dx = reference(hidden.float(), weight, ids, values)
    hidden.backward(dx)
    close(got, proj.weight.grad, "proj.weight.grad")


def test_the_engine_is_reused_call_after_call(backend):
    weight, hidden, ids, values, _, _ = problem(5)
    loss_fn = ht.HeadKLLoss(weight, backend=backend)
    first = loss_fn(hidden, ids, values).item()
    for _ in range(3):
        assert loss_fn(hidden, ids, values).item() == first


@pytest.mark.parametrize("divergence,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.3)])
def test_full_vocabulary_loss_matches_torch_f64(backend, divergence, beta):
    """FullVocabKLLoss: the teacher from its own hidden rows and head (of
    another hidden size), over the whole vocabulary."""
    from reference import full_vocab_reference

    weight, hidden, _, _, _, weights = problem(13)
    g = torch.Generator().manual_seed(14)
    teacher_hs = 24
    teacher_weight = torch.randint(-8, 9, (V, teacher_hs), generator=g).float() / 32
    teacher_hidden = torch.randint(-8, 9, hidden.shape[:-1] + (teacher_hs,), generator=g).float() / 16
    loss_fn = ht.FullVocabKLLoss(weight, teacher_weight, divergence=divergence, beta=beta, temperature=1.5, backend=backend)
    x = hidden.clone().requires_grad_()
    loss = loss_fn(x, teacher_hidden, weights=weights)
    loss.backward()
    want_loss, want_dx = full_vocab_reference(
        hidden.reshape(-1, HS), weight, teacher_hidden.reshape(-1, teacher_hs), teacher_weight,
        weights=weights.reshape(-1), divergence=divergence, beta=beta, temperature=1.5,
    )  # fmt: skip
    close(loss.reshape(1), want_loss.reshape(1), "loss", rel=1e-4)
    close(x.grad.reshape(-1, HS), want_dx, "dx")
    with pytest.raises(ValueError, match="teacher_hidden"):
        loss_fn(x, teacher_hidden[..., :-1])


def test_gradient_scale_and_the_auto_filter(backend):
    """``gscale`` changes only how the f16 gradient is scaled; the filter
    ("auto": 2^-15) keeps the loss exact and drops only tiny products."""
    weight, hidden, ids, values, _, _ = problem(17)
    want_loss, want_dx = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K))
    for kw, rel in [(dict(gscale=512.0), 2e-3), (dict(filter_eps="auto"), 2e-2)]:
        x = hidden.clone().requires_grad_()
        loss = ht.HeadKLLoss(weight, backend=backend, **kw)(x, ids, values)
        loss.backward()
        close(loss.reshape(1), want_loss.reshape(1), f"loss {kw}", rel=1e-4)
        close(x.grad.reshape(-1, HS), want_dx, f"dx {kw}", rel=rel)
    with pytest.raises(ValueError, match="gscale"):
        ht.HeadKLLoss(weight, gscale=-1.0)
