"""Mesa's "XDG_RUNTIME_DIR is invalid or not set" lines stay off the
caller's stderr where the variable is unset, without headkl setting it
(a library leaves its caller's environment alone); every other line
written to stderr during the engine's opening still reaches it."""

import os
import subprocess
import sys
import textwrap

import pytest

from headkl._stderr import quiet_mesa

MESA = b"error: XDG_RUNTIME_DIR is invalid or not set in the environment.\n"

OPEN_GPU_HEADS = textwrap.dedent(
    """
    import os, sys, torch, headkl, headkl._engine, headkl.torch as ht
    if sys.argv[1] == "unquieted":  # the control: headkl's quieting off
        headkl.quiet_mesa = headkl._engine.quiet_mesa = lambda call, *args, **kwargs: call(*args, **kwargs)
    started, why = [], []
    headkl.devices()
    for backend in ("wgpu", "vulkan", "auto"):
        try:
            ht.Head(torch.randn(64, 8), backend=backend).topk(torch.randn(2, 8), 4)
            started.append(backend)
        except Exception as e:
            why.append(f"{backend}: {e}")
    print("started:", " ".join(started))
    print("why:", "; ".join(why))
    print("environ has XDG_RUNTIME_DIR:", "XDG_RUNTIME_DIR" in os.environ)
    """
)


def open_gpu_heads(how):
    """The script's stdout lines as a dict, and its stderr, run with XDG_RUNTIME_DIR unset."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    command = [sys.executable, "-c", OPEN_GPU_HEADS, how]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line), run.stderr


def test_opening_gpu_heads_prints_no_mesa_line_and_leaves_the_environment():
    lines, stderr = open_gpu_heads("quieted")
    assert lines["environ has XDG_RUNTIME_DIR"] == "False"
    if not {"vulkan", "wgpu"} & set(lines["started"].split()):
        pytest.skip(f"neither vulkan nor wgpu starts here, so Mesa is never reached: {lines['why']}")
    assert "XDG_RUNTIME_DIR" not in stderr, stderr
    # The control: without headkl's quieting the same script prints Mesa's lines here.
    control_lines, control = open_gpu_heads("unquieted")
    if "XDG_RUNTIME_DIR" not in control:
        pytest.skip("this machine's Vulkan driver prints no XDG_RUNTIME_DIR line: nothing to quiet")
    assert control_lines["environ has XDG_RUNTIME_DIR"] == "False"


def test_other_lines_are_written_back_and_mesas_dropped(capfd, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    before = os.fstat(2).st_ino

    def noisy(a, b=0):
        os.write(2, b"first\n" + MESA + b"MESA: error: XDG_RUNTIME_DIR not set in the environment.\nlast\n")
        return a + b

    assert quiet_mesa(noisy, 2, b=3) == 5
    err = capfd.readouterr().err
    assert err == "first\nlast\n", err
    assert os.fstat(2).st_ino == before and "XDG_RUNTIME_DIR" not in os.environ


def test_a_call_that_raises_restores_stderr(capfd, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    before = os.fstat(2).st_ino

    def fails():
        os.write(2, MESA + b"why it failed\n")
        raise ValueError("no device")

    with pytest.raises(ValueError, match="no device"):
        quiet_mesa(fails)
    assert os.fstat(2).st_ino == before
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "why it failed\nafter\n"


def test_with_a_runtime_folder_nothing_is_redirected(capfd, monkeypatch, tmp_path):
    """Where the variable names a folder Mesa is quiet, and the call runs as it is."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    seen = []
    quiet_mesa(lambda: seen.append(os.fstat(2).st_ino))
    assert seen == [os.fstat(2).st_ino]
    quiet_mesa(lambda: os.write(2, MESA))
    assert capfd.readouterr().err == MESA.decode()
