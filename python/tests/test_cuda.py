"""CUDA tensors with no byte through the host, on each GPU path: the CUDA
backend (the engine on the tensors' own memory, on torch's stream) and
Vulkan's zero-copy path (Vulkan memory and a timeline semaphore shared with
CUDA), against the same loss on CPU tensors and against PyTorch float64.
Needs a CUDA device (and, for Vulkan, a Vulkan driver exposing it): elsewhere
each test is skipped with why."""

import logging

import pytest
import torch

import headkl.torch as ht
from conftest import start_or_skip
from reference import reference
from test_loss import HS, K, close, problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(params=("cuda", "vulkan"))
def gpu(request):
    """The backend whose direct path on CUDA tensors a test runs."""
    return start_or_skip(request.param)


def direct_or_skip(head, gpu):
    """Skips where Vulkan cannot share memory with CUDA on this device (the
    CUDA backend always runs on CUDA tensors)."""
    if gpu == "vulkan" and head._engine.interop() is not None:
        pytest.skip(f"no zero-copy on this device: {head._engine.interop()}")


def cuda_loss(gpu, **kw):
    weight = problem(7)[0]
    loss_fn = ht.HeadKLLoss(weight, backend=gpu, **kw)
    direct_or_skip(loss_fn.head, gpu)
    return loss_fn


@pytest.mark.parametrize(
    "opts",
    [{}, dict(reduction="none", temperature=2.0), dict(weight_hard_loss=0.5, label_smoothing=0.1), dict(tail="bucket")],
    ids=["default", "none-tau2", "hard", "bucket"],
)
def test_zero_copy_matches_torch_f64_and_moves_nothing_through_the_host(opts, gpu):
    weight, hidden, ids, values, labels, weights = problem(7)
    loss_fn = cuda_loss(gpu, **opts)
    before = ht.host_copy_bytes()
    for step in range(3):
        x = hidden.cuda().requires_grad_()
        loss = loss_fn(x, ids.cuda(), values.cuda(), labels=labels.cuda(), weights=weights.cuda())
        assert loss_fn.zero_copy, "the CUDA call went through host copies"
        loss.sum().backward()
    torch.cuda.synchronize()
    loss_fn.synchronize()
    assert ht.host_copy_bytes() == before, "bytes went through the host"
    want_loss, want_dx = reference(
        hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K),
        labels=labels.reshape(-1), weights=weights.reshape(-1), **opts,
    )  # fmt: skip
    close(loss.detach().cpu().reshape(-1), want_loss.reshape(-1), "loss", rel=1e-4)
    close(x.grad.cpu().reshape(-1, HS), want_dx, "dx")


def test_zero_copy_bf16_rows_and_a_growing_batch(gpu):
    loss_fn = cuda_loss(gpu)
    for lead in [(2, 5), (4, 9), (1, 3)]:
        weight, hidden, ids, values, _, _ = problem(11, lead=lead)
        x = hidden.to(torch.bfloat16).cuda().requires_grad_()
        loss = loss_fn(x, ids.cuda(), values.cuda())
        loss.backward()
        want_loss, want_dx = reference(hidden.reshape(-1, HS), problem(7)[0], ids.reshape(-1, K), values.reshape(-1, K))
        close(loss.detach().cpu().reshape(1), want_loss.reshape(1), "loss", rel=1e-3)
        close(x.grad.float().cpu().reshape(-1, HS), want_dx, "dx", rel=2e-2)


def test_a_bad_id_on_the_device_raises_at_synchronize_and_the_engine_recovers(gpu):
    weight, hidden, ids, values, _, _ = problem(7)
    loss_fn = cuda_loss(gpu)
    bad = ids.clone()
    bad[0, 0, 0] = 10_000
    loss_fn(hidden.cuda(), bad.cuda(), values.cuda())
    with pytest.raises(ValueError, match="10000"):
        loss_fn.synchronize()
    good = loss_fn(hidden.cuda(), ids.cuda(), values.cuda())
    loss_fn.synchronize()
    want, _ = reference(hidden.reshape(-1, HS), weight, ids.reshape(-1, K), values.reshape(-1, K))
    close(good.detach().cpu().reshape(1), want.reshape(1), "loss", rel=1e-4)


def test_the_host_path_on_cuda_tensors_is_counted():
    weight, hidden, ids, values, _, _ = problem(7)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    before = ht.host_copy_bytes()
    loss_fn(hidden.cuda(), ids.cuda(), values.cuda())
    assert ht.host_copy_bytes() > before


def test_zero_copy_topk_and_gather_match_the_host_path(gpu):
    weight, hidden, ids, _, _, _ = problem(5)
    weight = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) / 8
    head = ht.Head(weight, backend=gpu)
    direct_or_skip(head, gpu)
    on_host = ht.Head(weight, backend=gpu)
    before = ht.host_copy_bytes()
    top = head.topk(hidden.cuda(), 12, temperature=1.5)
    lp = head.topk(hidden.cuda(), 12, temperature=1.5, form="logprobs")
    ids[0, 0, 0] = -1
    got = head.gather(hidden.cuda(), ids.cuda(), temperature=2.0)
    torch.cuda.synchronize()
    head.synchronize()
    assert ht.host_copy_bytes() == before, "bytes went through the host"
    want = on_host.topk(hidden, 12, temperature=1.5)
    assert torch.equal(top.ids.cpu(), want.ids)
    assert (top.values.cpu() - want.values).abs().max() < 1e-6
    assert (lp.values.cpu() - on_host.topk(hidden, 12, temperature=1.5, form="logprobs").values).abs().max() < 1e-5
    want_g = on_host.gather(hidden, ids, temperature=2.0)
    assert got.logprobs[0, 0, 0].item() == -float("inf")
    mask = ids >= 0
    assert (got.logprobs.cpu()[mask] - want_g.logprobs[mask]).abs().max() < 1e-5
    assert (got.lse.cpu() - want_g.lse).abs().max() < 1e-5


def test_zero_copy_re_reads_a_changed_head(gpu):
    """A head changed in place between zero-copy calls: the engine is made
    again (the shared buffers and semaphore of the last one let go once the
    device is done), and the next calls go zero-copy on the new head."""
    weight, hidden, ids, values, _, _ = problem(7)
    held = weight.clone()
    loss_fn = ht.HeadKLLoss(held, backend=gpu)
    direct_or_skip(loss_fn.head, gpu)
    head = ht.Head(held, backend=gpu)
    before = ht.host_copy_bytes()
    stale = loss_fn(hidden.cuda(), ids.cuda(), values.cuda())
    stale_top = head.topk(hidden.cuda(), 12)
    assert loss_fn.zero_copy
    held.mul_(2)
    for _ in range(2):
        x = hidden.cuda().requires_grad_()
        loss = loss_fn(x, ids.cuda(), values.cuda())
        assert loss_fn.zero_copy, "the CUDA call went through host copies"
        loss.backward()
        top = head.topk(hidden.cuda(), 12)
    torch.cuda.synchronize()
    loss_fn.synchronize()
    head.synchronize()
    assert ht.host_copy_bytes() == before, "bytes went through the host"
    assert loss_fn.head._uploads == head._uploads == 2
    want_loss, want_dx = reference(hidden.reshape(-1, HS), weight * 2, ids.reshape(-1, K), values.reshape(-1, K))
    close(loss.detach().cpu().reshape(1), want_loss.reshape(1), "loss", rel=1e-4)
    close(x.grad.cpu().reshape(-1, HS), want_dx, "dx")
    assert abs(loss.item() - stale.item()) > 1e-3
    want_top = ht.Head(held.clone(), backend=gpu).topk(hidden, 12)
    assert torch.equal(top.ids.cpu(), want_top.ids)
    assert (top.values.cpu() - want_top.values).abs().max() < 1e-6
    assert (top.values - stale_top.values).abs().max() > 1e-3


def test_a_trainable_head_on_cuda_gets_its_gradient(caplog, gpu):
    """A head that requires grad, on the GPU with the rows. On the CUDA
    backend the same direct call gives the head's gradient; on Vulkan the
    call takes the host path (its zero-copy loss does not compute it) and
    says why once on the ``headkl`` logger. Either way the gradient comes
    back on the head's device in its dtype, and under ``torch.no_grad()``
    the loss goes zero-copy."""
    import headkl._host

    caplog.set_level(logging.INFO, logger="headkl")
    headkl._host._said_head_grad_on_host = False
    weight, hidden, ids, values, _, _ = problem(7)
    w = weight.cuda().to(torch.bfloat16).requires_grad_()
    loss_fn = ht.HeadKLLoss(w, backend=gpu)
    direct_or_skip(loss_fn.head, gpu)
    before = ht.host_copy_bytes()
    for _ in range(2):
        w.grad = None
        x = hidden.cuda().requires_grad_()
        loss = loss_fn(x, ids.cuda(), values.cuda())
        assert loss_fn.zero_copy == (gpu == "cuda")
        (loss * 3).backward()
    torch.cuda.synchronize()
    assert w.grad.device == w.device and w.grad.dtype == torch.bfloat16
    _, want_dx, want_dw = reference(hidden.reshape(-1, HS), weight.to(torch.bfloat16).float(), ids.reshape(-1, K),
                                    values.reshape(-1, K), head_grad=True, upstream=3.0)  # fmt: skip
    close(x.grad.cpu().reshape(-1, HS), want_dx, "dx")
    close(w.grad.double().cpu(), want_dw, "weight.grad", rel=1e-2)
    said = [r.getMessage() for r in caplog.records if "the head requires grad" in r.getMessage()]
    if gpu == "cuda":
        assert said == [] and ht.host_copy_bytes() == before, said
    else:
        assert len(said) == 1 and "zero-copy path does not compute" in said[0], said
    with torch.no_grad():
        loss_fn(hidden.cuda(), ids.cuda(), values.cuda())
    assert loss_fn.zero_copy
    loss_fn.synchronize()


def test_a_trainable_head_on_the_cuda_backend_trains_on_the_device():
    """SGD on a CUDA head through the CUDA backend, per-token losses with an
    uneven upstream gradient: every step's loss and the final head match
    the same steps in float64, no byte of the rows or the head crosses to
    the host, and each step's changed head is read again on the device."""
    start_or_skip("cuda")
    weight, hidden, ids, values, _, _ = problem(7)
    w = weight.cuda().requires_grad_()
    loss_fn = ht.HeadKLLoss(w, backend="cuda", reduction="none")
    opt = torch.optim.SGD([w], lr=0.5)
    want_w = weight.double().clone()
    x, i, v = hidden.cuda(), ids.cuda(), values.cuda()
    up = torch.linspace(0.5, 2.0, hidden.numel() // HS).reshape(hidden.shape[:-1])
    before = ht.host_copy_bytes()
    for step in range(4):
        opt.zero_grad()
        loss = loss_fn(x, i, v)
        assert loss_fn.zero_copy, "the CUDA call went through host copies"
        loss.backward(up.cuda())
        opt.step()
        want_loss, _, want_dw = reference(hidden.reshape(-1, HS), want_w, ids.reshape(-1, K), values.reshape(-1, K),
                                          head_grad=True, upstream=up.reshape(-1).double(), reduction="none")  # fmt: skip
        close(loss.detach().cpu().reshape(-1), want_loss.reshape(-1), f"loss at step {step}", rel=1e-4)
        want_w -= 0.5 * want_dw
    torch.cuda.synchronize()
    loss_fn.synchronize()
    assert ht.host_copy_bytes() == before, "bytes went through the host"
    assert loss_fn.head._uploads == 4, "the head is read again after each step but the last"
    close(w.detach().double().cpu(), want_w, "the trained head", rel=1e-3)


def test_a_tile_aligned_head_gets_its_gradient_in_its_own_buffer():
    """V and hs multiples of 16: the CUDA backend builds the head's
    gradient in the unit-gradient tensor itself, its chunks' inputs parked
    there and one GEMM per part of the vocabulary after the last (21
    tokens; 4096 have no room there, so a GEMM per chunk), scaled by its
    alpha on the device. Both match float64, with a logit scale folded
    into that alpha."""
    start_or_skip("cuda")
    g = torch.Generator().manual_seed(11)
    vocab, hs, k = 304, 48, 8
    weight = torch.randint(-8, 9, (vocab, hs), generator=g).float() / 32
    # 21 tokens in chunks of a small budget; 4096 in the default's.
    for tokens, budget in [(21, 1 << 16), (4096, None)]:
        hidden = torch.randint(-8, 9, (tokens, hs), generator=g).float() / 16
        ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(tokens)])
        probs = torch.rand(tokens, k, generator=g) + 0.05
        values = probs / probs.sum(-1, keepdim=True) * 0.9
        w = weight.cuda().requires_grad_()
        opts = {"logit_scale": 0.75, "budget_bytes": budget}
        loss_fn = ht.HeadKLLoss(w, backend="cuda", **opts)
        x = hidden.cuda().requires_grad_()
        loss = loss_fn(x, ids.cuda(), values.cuda())
        assert loss_fn.zero_copy
        (loss * 3).backward()
        torch.cuda.synchronize()
        want_loss, want_dx, want_dw = reference(hidden, weight, ids, values, head_grad=True, upstream=3.0,
                                                logit_scale=0.75)  # fmt: skip
        close(loss.detach().cpu().reshape(-1), want_loss.reshape(-1), f"loss, {tokens} tokens", rel=1e-4)
        close(x.grad.cpu(), want_dx, f"dx, {tokens} tokens")
        close(w.grad.double().cpu(), want_dw, f"weight.grad, {tokens} tokens")


def test_a_step_on_the_cuda_backend_makes_no_host_sync():
    """torch's sync debug mode set to error: a forward and backward step on
    the CUDA backend queues on torch's stream and never waits on the host
    (a sync would raise), and its results match PyTorch float64."""
    start_or_skip("cuda")
    weight, hidden, ids, values, labels, weights = problem(7)
    loss_fn = ht.HeadKLLoss(weight, backend="cuda", weight_hard_loss=0.5)
    x0, ids, values, labels, weights = (t.cuda() for t in (hidden, ids, values, labels, weights))
    loss_fn(x0, ids, values, labels=labels, weights=weights)  # the first call makes the engine's scratch
    torch.cuda.synchronize()
    x = x0.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = loss_fn(x, ids, values, labels=labels, weights=weights)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss_fn.zero_copy
    want_loss, want_dx = reference(
        hidden.reshape(-1, HS), weight, ids.cpu().reshape(-1, K), values.cpu().reshape(-1, K),
        labels=labels.cpu().reshape(-1), weights=weights.cpu().reshape(-1), weight_hard_loss=0.5,
    )  # fmt: skip
    close(loss.detach().cpu().reshape(1), want_loss.reshape(1), "loss", rel=1e-4)
    close(x.grad.cpu().reshape(-1, HS), want_dx, "dx")


def test_a_step_with_a_trainable_bf16_head_on_the_cuda_backend_makes_no_host_sync():
    """As above with a bf16 head that requires grad and an upstream
    gradient of 3 from the device: forward, the head's gradient and its
    scale into ``.grad`` (the Triton kernel, where there is one) never wait
    on the host, and ``.grad`` matches PyTorch float64."""
    start_or_skip("cuda")
    weight, hidden, ids, values, _, _ = problem(7)
    w = weight.cuda().to(torch.bfloat16).requires_grad_()
    loss_fn = ht.HeadKLLoss(w, backend="cuda")
    x0, ids, values = (t.cuda() for t in (hidden, ids, values))
    (loss_fn(x0, ids, values) * 3).backward()  # the first step makes the scratch and kernels
    torch.cuda.synchronize()
    w.grad = None
    x = x0.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (loss_fn(x, ids, values) * 3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _, want_dx, want_dw = reference(hidden.reshape(-1, HS), weight.to(torch.bfloat16).float(), ids.cpu().reshape(-1, K),
                                    values.cpu().reshape(-1, K), head_grad=True, upstream=3.0)  # fmt: skip
    close(x.grad.cpu().reshape(-1, HS), want_dx, "dx")
    assert w.grad.dtype == torch.bfloat16
    close(w.grad.double().cpu(), want_dw, "weight.grad", rel=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_head_read_again_in_windows_matches_a_fresh_one_and_names_a_bad_value(dtype, monkeypatch):
    # The CUDA backend reads a changed CUDA head again on the device, its
    # checks a window of rows at a time: 7 rows a window here, so the
    # 300-row head takes 43 windows, the last one short.
    import headkl._cuda_direct as direct

    start_or_skip("cuda")
    monkeypatch.setattr(direct, "_REFILL_WINDOW_BYTES", 7 * 2 * HS)
    weight, hidden, ids, values, _, _ = problem(7)
    w = weight.to(dtype).cuda()
    loss_fn = ht.HeadKLLoss(w, backend="cuda")
    args = (hidden.cuda(), ids.cuda(), values.cuda())
    loss_fn(*args)
    with torch.no_grad():
        w.mul_(2)
        w[291] += 0.5  # a row of the last window
    got = loss_fn(*args)
    assert loss_fn.head._uploads == 2, "the changed head was not read again"
    want = ht.HeadKLLoss(w.clone(), backend="cuda")(*args)
    close(got.cpu().reshape(1), want.cpu().reshape(1), "loss read again", rel=1e-6)
    with torch.no_grad():
        w[150, 3] = float("inf")
    with pytest.raises(ValueError, match=r"weight: row 150, column 3: inf is not finite"):
        loss_fn(*args)
    if dtype == torch.float32:
        with torch.no_grad():
            w[150, 3] = 70000.0  # rounds to f16's infinity
        with pytest.raises(ValueError, match=r"weight: row 150, column 3: 70000.0 is past f16's range"):
            loss_fn(*args)
    # Mended, the head is read again at the next call.
    with torch.no_grad():
        w[150, 3] = 0.25
    got = loss_fn(*args)
    want = ht.HeadKLLoss(w.clone(), backend="cuda")(*args)
    close(got.cpu().reshape(1), want.cpu().reshape(1), "loss of the mended head", rel=1e-6)
