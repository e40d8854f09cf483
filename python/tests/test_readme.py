"""The README's PyTorch snippets run as written, in order, as a reader
runs them (a user's first minutes): the first is complete by itself, and
each later one uses the names the ones before it made."""

import os
import re
import textwrap

import torch

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def section():
    """The section "Use it from PyTorch"."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Use it from PyTorch") :]
    return section[: section.index("\n## ", 1)]


def snippets():
    """The section's ```python blocks (a block inside a list item dedented)."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", section(), flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def run(*blocks):
    """The blocks run in order in one scope, with nothing defined before them."""
    scope = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md (python block {i + 1})", "exec"), scope)
    return scope


def test_the_readme_snippet_runs_as_written():
    scope = run(snippets()[0])
    assert scope["hidden"].grad is not None and scope["hidden"].grad.abs().sum() > 0
    assert scope["loss"].dim() == 0 and torch.isfinite(scope["loss"])
    assert scope["top"].ids.shape == (2, 8, 64)
    assert torch.isfinite(scope["lp"].logprobs).all()


def test_the_install_steps_say_what_comes_first():
    text = section()
    install = text[: text.index("```python")]
    needed = ["pip install torch", "pip install ./python", "pip install pytest", "1.13", "Rust toolchain", "about 1 GB"]
    for said in needed + ["6 minutes on 2 cores"]:
        assert said in install, said
    commands = re.search(r"```sh\n(.*?)```", install, flags=re.S).group(1)
    assert commands.index("pip install torch") < commands.index("pip install ./python") < commands.index("pytest")


def test_the_trainable_tied_and_frozen_head_snippet_runs():
    blocks = snippets()
    assert len(blocks) == 3, len(blocks)
    scope = run(*blocks[:2])
    assert scope["lm_head"].weight.grad is not None and scope["lm_head"].weight.grad.abs().sum() > 0
    embed = scope["embed"]
    assert embed.weight.grad is not None and embed.weight.grad.abs().sum() > 0
    # The head's share reaches rows no token looked up (the lookup's alone would not).
    unused = torch.ones(embed.weight.shape[0], dtype=torch.bool)
    unused[scope["tokens"].reshape(-1)] = False
    assert embed.weight.grad[unused].abs().sum() > 0
    assert scope["tied_fn"].head._uploads == 2
    assert not scope["frozen_fn"].head._weight.requires_grad


def test_the_precision_functional_and_copy_snippet_runs():
    scope = run(*snippets())
    assert scope["x"].grad is not None and scope["x"].grad.dtype == torch.float16
    assert torch.isfinite(scope["kl"]) and torch.isfinite(scope["jsd"])
    assert scope["lm_head"].weight.grad is not None
    assert scope["twin"].head._engine is not None and scope["twin"].head._engine is not scope["loss_fn"].head._engine
