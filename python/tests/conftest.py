"""Every test that takes ``backend`` runs on each backend: the f64 CPU
reference always, the GPU backends where they start. A GPU backend that
cannot start is a skip that says why, and a failure where ``HEADKL_REQUIRE``
names it (as CI sets it)."""

import os
import sys
import tempfile

import pytest

# Mesa's Vulkan drivers want a runtime folder; the test harness gives one
# (the package itself never sets the environment).
if not os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="headkl-runtime-")

import headkl  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

BACKENDS = ("reference", "cuda", "vulkan", "wgpu")


def _required():
    return {b.strip() for b in os.environ.get("HEADKL_REQUIRE", "").split(",") if b.strip()}


def _why_not(backend):
    """None where ``backend`` has a device, else why not."""
    rows = [d for d in headkl.devices() if d["backend"] == backend]
    if any("error" not in d for d in rows):
        return None
    return "; ".join(d.get("error", "no devices") for d in rows) or "no devices"


def start_or_skip(name):
    """``name`` where that backend has a device; else the test is skipped
    with why, or fails where ``HEADKL_REQUIRE`` names the backend."""
    why = _why_not(name)
    if why is not None:
        if name in _required():
            pytest.fail(f"{name} cannot start and HEADKL_REQUIRE names it: {why}")
        pytest.skip(f"{name} cannot start: {why}")
    return name


@pytest.fixture(params=BACKENDS)
def backend(request):
    return start_or_skip(request.param)
