"""A small PyTorch student distilled through headkl's loss from a teacher
top-k file the package makes (or ``headkl topk``, with ``--headkl``).

    python python/examples/distill.py --steps 40

1. A fixed teacher network gives hidden rows ``3·tanh(E[token]·M)`` for a
   batch of tokens; the teacher's exact top-k of them through the head ``W``
   ``[V][hs]`` (``headkl.functional.topk``) is written as a safetensors
   teacher file (``ids``, ``probs``), as a trainer would keep it, and read
   back. With ``--headkl PATH`` the command writes it instead, from the head
   and the rows written as safetensors.
2. The student (token embeddings and a two-layer MLP, torch's Adam) learns
   to match that top-k through ``headkl.torch.HeadKLLoss`` on the same head.

It prints each step's loss, then ``loss: first X last Y``. ``--device
cuda`` keeps the student on the GPU.
"""

import argparse
import os
import shutil
import subprocess
import tempfile

import torch

import headkl.torch as ht
from headkl.functional import topk


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="Adam steps (default 40)")
    p.add_argument("--ntok", type=int, default=256, help="tokens per step (default 256)")
    p.add_argument("--inputs", type=int, default=64, help="distinct input tokens (default 64)")
    p.add_argument("--vocab", type=int, default=1024, help="the head's vocabulary (default 1024)")
    p.add_argument("--hs", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--k", type=int, default=16, help="the teacher's top-k (default 16)")
    p.add_argument("--lr", type=float, default=0.02, help="Adam's learning rate (default 0.02)")
    p.add_argument("--seed", type=int, default=1, help="seed of the head, teacher, student and tokens")
    p.add_argument("--headkl", default=None, help="make the teacher file with this headkl command (default: the package)")
    p.add_argument("--backend", default="auto", help="headkl backend: auto, cuda, vulkan, wgpu, reference")
    p.add_argument("--device", default="cpu", help="where the student's tensors live: cpu or cuda")
    return p.parse_args()


def teacher_file(args, weight, hidden, workdir):
    """The teacher's top-k file, from the head and the teacher's hidden rows:
    made by the package, or by ``headkl topk`` where ``--headkl`` names it."""
    out = os.path.join(workdir, "teacher_topk.safetensors")
    if args.headkl is None:
        top = topk(hidden, weight, args.k, backend=args.backend)
        ht.write_safetensors(out, {"ids": top.ids, "probs": top.values})
        return ht.read_safetensors(out)
    command = shutil.which(args.headkl) or args.headkl
    head_path = os.path.join(workdir, "head.safetensors")
    hidden_path = os.path.join(workdir, "teacher_hidden.safetensors")
    ht.write_safetensors(head_path, {"weight": weight})
    ht.write_safetensors(hidden_path, {"hidden": hidden})
    subprocess.run(
        [command, "--quiet", "topk", "--head", head_path, "--hidden", hidden_path, "--k", str(args.k), "--out", out],
        check=True,
    )
    return ht.read_safetensors(out)


class Student(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = torch.nn.Embedding(args.inputs, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, args.hs))

    def forward(self, tokens):
        return self.mlp(self.embed(tokens))


def main():
    args = arguments()
    g = torch.Generator().manual_seed(args.seed)
    weight = (torch.rand(args.vocab, args.hs, generator=g) * 2 - 1) * (3 / args.hs**0.5)
    tokens = torch.randint(0, args.inputs, (args.ntok,), generator=g)
    e = torch.randn(args.inputs, 32, generator=g)
    m = torch.randn(32, args.hs, generator=g) / 32**0.5
    teacher_hidden = 3 * torch.tanh(e[tokens] @ m)

    with tempfile.TemporaryDirectory() as workdir:
        teacher = teacher_file(args, weight, teacher_hidden, workdir)
    device = torch.device(args.device)
    ids, probs = teacher["ids"].to(device), teacher["probs"].to(device)

    torch.manual_seed(args.seed)
    student = Student(args).to(device)
    loss_fn = ht.HeadKLLoss(weight, backend=args.backend)
    print(f"distill: headkl on {loss_fn.info['backend']} ({loss_fn.info['name']}); student on {device}")
    optim = torch.optim.Adam(student.parameters(), lr=args.lr)
    tokens = tokens.to(device)
    losses = []
    for step in range(args.steps):
        optim.zero_grad()
        loss = loss_fn(student(tokens), ids, probs)
        loss.backward()
        optim.step()
        losses.append(loss.item())
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}")
    print(f"loss: first {losses[0]:.4f} last {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
