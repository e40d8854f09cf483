"""A head that requires grad (a trainable or tied head): the
losses return its gradient through autograd, checked against the loss
written in PyTorch float64 (tests/reference.py) for every option; a tiny
student whose input embedding is tied to its head trains step for step as
the same student in plain PyTorch does; a frozen head costs nothing more
and gets no gradient; and what gets no gradient (the teacher's side, the
sharded loss's head) is refused rather than dropped in silence."""

import logging

import os

import pytest
import torch
import torch.nn.functional as F

import headkl.torch as ht
from reference import full_vocab_reference, reference
from test_head_refresh import full_vocab_problem
from test_loss import CASES, HS, K, V, case_problem, close, problem


class Spy:
    """The native engine, with the head-gradient array of each loss call
    recorded (None where the call did not ask for the head's gradient)."""

    def __init__(self, engine):
        self.engine, self.head_grads = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def head_kl(self, *args):
        self.head_grads.append(args[7] if len(args) > 7 else None)
        return self.engine.head_kl(*args)


def spied(loss_fn):
    loss_fn.head._engine = Spy(loss_fn.head._engine)
    return loss_fn.head._engine


# --- The head's gradient against PyTorch float64 ------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_head_gradient_matches_torch_f64(backend, case):
    opts, (weight, hidden, ids, values), call = case_problem(case)
    # An upstream gradient of 3; per token with "none", uneven (negative, zero and positive).
    none = opts.get("reduction") == "none"
    upstream = torch.linspace(-1.0, 2.0, hidden[..., 0].numel()).reshape(hidden.shape[:-1]) if none else 3.0
    upstream_flat = upstream.reshape(-1).double() if none else upstream
    flat = {k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    want_loss, want_dx, want_dw = reference(
        hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K), **flat,
        head_grad=True, upstream=upstream_flat, **opts,
    )  # fmt: skip
    w = weight.clone().requires_grad_()
    x = hidden.clone().requires_grad_()
    loss = ht.HeadKLLoss(w, backend=backend, **opts)(x, ids, values, **call)
    (loss * upstream).sum().backward()
    close(loss.detach().reshape(-1), want_loss.reshape(-1), "loss", rel=1e-4)
    close(x.grad.reshape(-1, HS), want_dx, "dx")
    close(w.grad, want_dw, "weight.grad")
    assert w.grad.dtype == w.dtype and w.grad.shape == w.shape


def test_uniform_upstream_takes_one_call_and_uneven_two():
    """With reduction="none", the head's gradient made in forward serves an
    upstream gradient that is the same for every token (``loss.sum()``);
    an uneven one (a mask, per-token weights) takes one more call."""
    weight, hidden, ids, values, _, _ = problem(3)
    w = weight.clone().requires_grad_()
    loss_fn = ht.HeadKLLoss(w, reduction="none", backend="reference")
    spy = spied(loss_fn)
    (loss_fn(hidden, ids, values).sum() * 2).backward()
    assert len(spy.head_grads) == 1 and spy.head_grads[0] is not None
    uniform = w.grad.clone()
    _, _, want = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K),
                           reduction="none", head_grad=True, upstream=2.0)  # fmt: skip
    close(uniform, want, "weight.grad (uniform)")
    w.grad = None
    mask = torch.ones(hidden.shape[:-1])
    mask[0] = 0
    (loss_fn(hidden, ids, values) * mask).sum().backward()
    assert len(spy.head_grads) == 3
    _, _, want = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K),
                           reduction="none", head_grad=True, upstream=mask.reshape(-1).double())  # fmt: skip
    close(w.grad, want, "weight.grad (masked)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gradient_comes_in_the_heads_dtype(dtype):
    weight, hidden, ids, values, _, _ = problem(5)
    w = weight.to(dtype).requires_grad_()
    x = hidden.to(torch.float16).requires_grad_()
    ht.HeadKLLoss(w, backend="reference")(x, ids, values).backward()
    _, want_dx, want_dw = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K),
                                    head_grad=True)  # fmt: skip
    assert w.grad.dtype == dtype and x.grad.dtype == torch.float16
    close(w.grad.double(), want_dw, "weight.grad", rel=1e-2)
    close(x.grad.double().reshape(-1, HS), want_dx, "dx", rel=1e-2)


def test_only_the_head_trains_when_the_rows_need_no_gradient():
    weight, hidden, ids, values, _, _ = problem(6)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    loss = ht.HeadKLLoss(lm_head.weight, backend="reference")(hidden, ids, values)
    loss.backward()
    _, _, want = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K), head_grad=True)
    close(lm_head.weight.grad, want, "weight.grad")


def test_a_second_derivative_still_raises_with_a_trainable_head():
    weight, hidden, ids, values, _, _ = problem(3)
    w = weight.clone().requires_grad_()
    loss = ht.HeadKLLoss(w, backend="reference")(hidden, ids, values)
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        g.pow(2).sum().backward()


# --- A tied embedding trained step for step against plain PyTorch -------------

TIED_V, TIED_HS, TIED_K, TIED_NTOK, TIED_INPUTS, STEPS = 256, 32, 8, 48, 64, 30


class TiedStudent(torch.nn.Module):
    """An embedding ``E`` ``[V][hs]`` that is also the head (GPT-2's tying)
    and one residual layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(TIED_V, TIED_HS)
        self.layer = torch.nn.Linear(TIED_HS, TIED_HS)
        torch.nn.init.normal_(self.embed.weight, std=0.3)

    def forward(self, tokens):
        h = self.embed(tokens)
        return h + torch.tanh(self.layer(h))


def tied_batches():
    """Each step's tokens and the teacher's top-k for them (a fixed top-k
    per input token, so the student has something to learn)."""
    g = torch.Generator().manual_seed(7)
    teacher_ids = torch.stack([torch.randperm(TIED_V, generator=g)[:TIED_K] for _ in range(TIED_INPUTS)])
    teacher_probs = torch.softmax(torch.randn(TIED_INPUTS, TIED_K, generator=g) * 2, -1)
    for step in range(STEPS):
        tokens = torch.randint(0, TIED_INPUTS, (TIED_NTOK,), generator=torch.Generator().manual_seed(1000 + step))
        yield tokens, teacher_ids[tokens], teacher_probs[tokens]


def plain_loss(hidden, weight, ids, probs):
    """The forward KL against the teacher's top-k renormalized, in plain
    PyTorch: ``logits = x @ Wᵀ``, the student's full-vocabulary
    log-softmax at the teacher's ids."""
    ls = F.log_softmax(hidden @ weight.T, -1).gather(-1, ids)
    t = probs / probs.sum(-1, keepdim=True)
    return (torch.xlogy(t, t) - t * ls).sum(-1).mean()


def train_tied(optimizer, backend=None):
    torch.manual_seed(0)
    model = TiedStudent()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loss_fn = None if backend is None else ht.HeadKLLoss(model.embed.weight, backend=backend)
    losses = []
    for tokens, ids, probs in tied_batches():
        opt.zero_grad()
        hidden = model(tokens)
        if loss_fn is None:
            loss = plain_loss(hidden, model.embed.weight, ids, probs)
        else:
            loss = loss_fn(hidden, ids, probs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), model.state_dict(), loss_fn


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_tied_embedding_trains_as_plain_pytorch_does(backend, optimizer, caplog):
    """30 steps of a student whose embedding is its head, same init and
    data: headkl's loss against plain PyTorch's, per step, and the final
    weights. The engine's GEMMs take f16 inputs, so the two drift apart by
    f16's rounding alone (seen on the reference backend and lavapipe: losses
    within 7e-5 relative, weights within 5e-4 of their scale)."""
    caplog.set_level(logging.INFO, logger="headkl")
    got, got_state, loss_fn = train_tied(optimizer, backend)
    want, want_state, _ = train_tied(optimizer)
    assert want[-1] < 0.5 * want[0], "the student did not learn: the comparison would be weak"
    err = (got - want).abs() / want.abs().clamp_min(1.0)
    assert err.max() <= 5e-4, f"loss per step: max relative error {err.max():.3e} at step {err.argmax()}"
    for name, w in want_state.items():
        close(got_state[name], w.double(), name, rel=5e-3)
    # Each optimizer step changed the head in place: each next call read it again.
    assert loss_fn.head._uploads == STEPS
    assert sum("re-read the head" in r.getMessage() for r in caplog.records) == STEPS - 1


# --- A frozen head -------------------------------------------------------------


def test_a_frozen_head_gets_no_gradient_and_asks_for_none():
    weight, hidden, ids, values, _, _ = problem(4)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    _, want_dx = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K))
    for how in ("detached", "requires_grad off", "no_grad"):
        lm_head.weight.requires_grad_(how != "requires_grad off")
        lm_head.weight.grad = None
        loss_fn = ht.HeadKLLoss(lm_head.weight.detach() if how == "detached" else lm_head.weight, backend="reference")
        spy = spied(loss_fn)
        x = hidden.clone().requires_grad_()
        if how == "no_grad":
            with torch.no_grad():
                loss = loss_fn(x, ids, values)
            assert loss.grad_fn is None
        else:
            loss_fn(x, ids, values).backward()
            close(x.grad.reshape(-1, HS), want_dx, f"dx ({how})")
        assert lm_head.weight.grad is None, how
        assert spy.head_grads == [None], how


def test_a_trainable_head_under_no_grad_then_with_grad():
    """The same loss, under ``torch.no_grad()`` (evaluation) then training:
    the head's gradient is asked only where it is needed."""
    weight, hidden, ids, values, _, _ = problem(4)
    w = weight.clone().requires_grad_()
    loss_fn = ht.HeadKLLoss(w, backend="reference")
    spy = spied(loss_fn)
    with torch.no_grad():
        evaluated = loss_fn(hidden, ids, values)
    trained = loss_fn(hidden, ids, values)
    trained.backward()
    assert evaluated.item() == trained.item()
    assert spy.head_grads[0] is None and spy.head_grads[1] is not None
    assert w.grad is not None and w.grad.abs().sum() > 0


# --- FullVocabKLLoss: the student's head only ---------------------------------


@pytest.mark.parametrize("divergence,reduction", [("forward", "mean"), ("reverse", "sum"), ("jsd", "none")])
def test_full_vocabulary_head_gradient_matches_torch_f64(backend, divergence, reduction):
    weight, teacher_weight, hidden, teacher_hidden, weights = full_vocab_problem()
    w = weight.clone().requires_grad_()
    x = hidden.clone().requires_grad_()
    loss_fn = ht.FullVocabKLLoss(w, teacher_weight, divergence=divergence, beta=0.3, temperature=1.5,
                                 reduction=reduction, backend=backend)  # fmt: skip
    loss = loss_fn(x, teacher_hidden, weights=weights)
    upstream = torch.linspace(0.0, 2.0, weights.numel()).reshape(weights.shape) if reduction == "none" else 3.0
    (loss * upstream).sum().backward()
    want_loss, want_dx, want_dw = full_vocab_reference(
        hidden.reshape(-1, HS), weight, teacher_hidden.reshape(-1, teacher_weight.shape[1]), teacher_weight,
        weights=weights.reshape(-1), divergence=divergence, beta=0.3, temperature=1.5, reduction=reduction,
        head_grad=True, upstream=upstream.reshape(-1).double() if reduction == "none" else upstream,
    )  # fmt: skip
    close(loss.detach().reshape(-1), want_loss.reshape(-1), "loss", rel=1e-4)
    close(x.grad.reshape(-1, HS), want_dx, "dx")
    close(w.grad, want_dw, "weight.grad")


def test_the_teacher_side_that_requires_grad_is_refused():
    weight, teacher_weight, hidden, teacher_hidden, _ = full_vocab_problem()
    teacher_head = torch.nn.Linear(teacher_weight.shape[1], V, bias=False)
    message = r"^teacher_weight: requires grad, but headkl returns no gradient for the teacher's side.*\.detach\(\)"
    with pytest.raises(ValueError, match=message):
        ht.FullVocabKLLoss(weight, teacher_head.weight, backend="reference")
    loss_fn = ht.FullVocabKLLoss(weight.clone().requires_grad_(), teacher_weight, backend="reference")
    message = r"^teacher_hidden: requires grad, but headkl returns no gradient for the teacher's side.*no_grad"
    with pytest.raises(ValueError, match=message):
        loss_fn(hidden, teacher_hidden.clone().requires_grad_())
    with torch.no_grad():  # no gradient is asked: nothing is dropped
        loss_fn(hidden, teacher_hidden.clone().requires_grad_())
    loss_fn(hidden, teacher_hidden).backward()
    assert loss_fn.head._weight.grad is not None


def test_the_sharded_loss_refuses_a_head_that_requires_grad():
    weight = problem(1)[0]
    rows = weight[:100].clone().requires_grad_()
    message = r"^weight: requires grad, but the sharded loss .* does not compute the head's gradient"
    with pytest.raises(ValueError, match=message):
        ht.HeadKLLoss(rows, shard=(0, 100), vocab_size=V, backend="reference")
    ht.HeadKLLoss(rows.detach(), shard=(0, 100), vocab_size=V, backend="reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gradient_is_scaled_into_the_weights_dtype_a_window_at_a_time(dtype, monkeypatch):
    # Into another dtype the scale goes 3 rows at a time (100 windows, the
    # 300 rows of the head), so PyTorch's temporary of the common dtype
    # stays a window's; each value is the f32 product rounded once, as in
    # one call.
    import headkl.ops._scale as scale
    import headkl.ops.autograd as autograd

    monkeypatch.setattr(scale, "_SCALE_WINDOW_BYTES", 3 * HS * 4)
    unit = torch.randn(V, HS, generator=torch.Generator().manual_seed(5))
    got = autograd._head_gradient(unit, torch.tensor(0.75), None, dtype, unit.device)
    assert got.dtype == dtype and got.shape == (V, HS)
    assert torch.equal(got, (unit * 0.75).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_cuda_gradient_is_scaled_in_one_kernel_where_triton_is_there(dtype):
    # On CUDA tensors the Triton kernel (where importable) reads each f32
    # value once and rounds the product once: PyTorch's values exactly, the
    # scale read from the device. 300·64 + 5 values: the last of the 5
    # programs is short.
    import headkl.ops._scale as scale

    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    unit = torch.randn(V * HS + 5, generator=torch.Generator().manual_seed(6)).cuda().reshape(-1, 1)
    factor = torch.tensor(-0.375, device="cuda")
    out = torch.full(unit.shape, float("nan"), dtype=dtype, device="cuda")
    got = scale.scale_into(unit, factor, out)
    assert got is out
    assert torch.equal(got, (unit * -0.375).to(dtype))
    assert scale._kernel_takes(unit, out) == scale.fused_kernel_available()
    if "cuda" in os.environ.get("HEADKL_REQUIRE", ""):
        assert scale.fused_kernel_available(), f"no Triton kernel: {scale._why_no_kernel}"
