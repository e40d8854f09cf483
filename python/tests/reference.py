"""The loss written in PyTorch float64, term by term as the README's "Loss
terms" table gives it, with autograd for the gradient: what the package is
checked against. The device rounds the head and the hidden rows to f16, so
the reference takes them through f16 first."""

import torch
import torch.nn.functional as F

FLOOR = 2.0**-24


def _bins(ls, t, tail):
    """Student and teacher log-shares over a row's bins (the k, plus the tail
    in bucket mode), as DESIGN §1 defines them per tail mode."""
    if tail == "renormalize":
        return ls - ls.logsumexp(-1, keepdim=True), t
    if tail == "none":
        return ls, t
    r_s = (1 - ls.exp().sum(-1, keepdim=True)).clamp_min(FLOOR)
    r_t = (1 - t.sum(-1, keepdim=True)).clamp_min(0)
    return torch.cat([ls, r_s.log()], -1), torch.cat([t, r_t], -1)


def _soft(ls, t, tail, divergence, beta):
    if divergence == "forward":
        # The forward KL in renormalize mode is against the full-vocabulary
        # p, not p/P (DESIGN §1).
        if tail == "renormalize":
            return (torch.xlogy(t, t) - t * ls).sum(-1)
        q, tt = _bins(ls, t, tail)
        return (torch.xlogy(tt, tt) - tt * q).sum(-1)
    q, tt = _bins(ls, t, tail)
    lt = tt.clamp_min(FLOOR).log()
    if divergence == "reverse":
        return (q.exp() * (q - lt)).sum(-1)
    if beta == 0:
        return (torch.xlogy(tt, tt) - tt * q).sum(-1)
    if beta == 1:
        return (q.exp() * (q - lt)).sum(-1)
    lt0 = torch.where(tt > 0, tt.log(), torch.full_like(tt, -float("inf")))
    lm = torch.logaddexp(q + torch.log(torch.tensor(1 - beta, dtype=q.dtype)), lt0 + torch.log(torch.tensor(beta, dtype=q.dtype)))
    return beta * (torch.xlogy(tt, tt) - tt * lm).sum(-1) + (1 - beta) * (q.exp() * (q - lm)).sum(-1)


def reference(x, weight, ids, values, labels=None, weights=None, total=None, head_grad=False, upstream=None, **o):
    """(loss, dx) of ``HeadKLLoss(weight, **o)(x, ids, values, labels=…,
    weights=…, total=…)`` in float64; with ``head_grad`` (loss, dx, dW),
    the head's gradient too. ``upstream`` is the gradient backward is given
    (default 1; per token with ``reduction="none"``)."""
    tau = o.get("temperature", 1.0)
    tail = o.get("tail", "renormalize")
    x = x.detach().to(torch.float16).double().requires_grad_()
    w16 = weight.detach().to(torch.float16).double().requires_grad_(head_grad)
    z = o.get("logit_scale", 1.0) * (x @ w16.T)
    if o.get("softcap") is not None:
        c = o["softcap"]
        z = c * torch.tanh(z / c)
    ls = F.log_softmax(z / tau, -1).gather(-1, ids)
    v = values.double()
    p_t = v.exp() if o.get("teacher_form", "probs") == "logprobs" else v
    if o.get("teacher_temperature") is not None:
        p_t = _rescale(p_t, tail, o["teacher_temperature"] / tau)
    t = p_t / p_t.sum(-1, keepdim=True) if tail == "renormalize" else p_t
    loss = o.get("weight_soft_loss", 1.0) * _soft(ls, t, tail, o.get("divergence", "forward"), o.get("beta", 0.5))
    ignore = o.get("ignore_index", -100)
    if labels is not None:
        y = torch.where((labels < 0) | (labels == ignore), torch.full_like(labels, -100), labels)
        if o.get("weight_hard_loss", 0.0) > 0:
            hard = F.cross_entropy(z, y, label_smoothing=o.get("label_smoothing", 0.0), ignore_index=-100, reduction="none")
            loss = loss + o["weight_hard_loss"] * hard
    if o.get("lse_square_scale", 0.0) > 0:
        loss = loss + o["lse_square_scale"] * torch.logsumexp(z, -1) ** 2
    w = torch.ones(x.shape[0], dtype=torch.float64) if weights is None else weights.double()
    if o.get("ignore_mask"):
        w = w * ((labels >= 0) & (labels != ignore))
    reduction = o.get("reduction", "mean")
    if reduction == "none":
        out = w * loss
    else:
        out = (w * loss).sum()
        if reduction == "mean":
            out = out / (w.sum() if total is None else total)
        elif reduction == "batchmean":
            out = out / x.shape[0]
    (out * (1.0 if upstream is None else upstream)).sum().backward()
    if head_grad:
        return out.detach(), x.grad, w16.grad
    return out.detach(), x.grad


def _rescale(p, tail, power):
    """The teacher's bins raised to ``power`` and renormalized over them
    (the tail one bin in bucket and none)."""
    raised = p.pow(power)
    norm = raised.sum(-1, keepdim=True)
    if tail != "renormalize":
        norm = norm + (1 - p.sum(-1, keepdim=True)).clamp_min(0).pow(power)
    return raised / norm


def full_vocab_reference(x, weight, teacher_hidden, teacher_weight, weights=None, divergence="jsd", beta=0.5,
                         temperature=1.0, reduction="mean", head_grad=False, upstream=None):  # fmt: skip
    """(loss, dx) of ``FullVocabKLLoss`` in float64: each divergence at k = V
    with the teacher's exact softmax (DESIGN §1, "The teacher's hidden
    rows"), the reverse KL's floor on log t; with ``head_grad`` (loss, dx,
    dW), and ``upstream`` as ``reference``'s."""
    x = x.detach().to(torch.float16).double().requires_grad_()
    w16 = weight.detach().to(torch.float16).double().requires_grad_(head_grad)
    ls = F.log_softmax((x @ w16.T) / temperature, -1)
    zt = teacher_hidden.to(torch.float16).double() @ teacher_weight.to(torch.float16).double().T
    lt = F.log_softmax(zt / temperature, -1)
    if divergence == "forward":
        per = (lt.exp() * (lt - ls)).sum(-1)
    elif divergence == "reverse":
        per = (ls.exp() * (ls - lt.clamp_min(torch.log(torch.tensor(FLOOR, dtype=lt.dtype))))).sum(-1)
    else:
        b = torch.tensor(beta, dtype=ls.dtype)
        lm = torch.logaddexp(ls + torch.log(1 - b), lt + torch.log(b))
        per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    w = torch.ones(x.shape[0], dtype=torch.float64) if weights is None else weights.double()
    out = {"mean": lambda: (w * per).sum() / w.sum(), "sum": lambda: (w * per).sum(), "none": lambda: w * per}[reduction]()
    (out * (1.0 if upstream is None else upstream)).sum().backward()
    if head_grad:
        return out.detach(), x.grad, w16.grad
    return out.detach(), x.grad
