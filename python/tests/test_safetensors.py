"""``read_safetensors`` and ``write_safetensors`` (over the ``safetensors``
package): what they keep (dtypes, shapes, the ``__metadata__`` block), the
file as the ``headkl`` command reads and writes it, and errors that name
the file."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import headkl.torch as ht

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _header(path):
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return size, json.loads(f.read(size))


def _raw_file(path, tensors, metadata=None):
    """A safetensors file laid out by hand, as the command's `safetensors`
    crate writes one: `__metadata__` and the tensors in the header, names
    not sorted, the header padded with spaces to 8 bytes."""
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, t) in tensors.items():
        blob = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_round_trip_keeps_dtypes_shapes_and_metadata(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "probs": torch.rand(5, 4, generator=g),
        "ids": torch.randint(0, 100, (5, 4), generator=g),
        "ids32": torch.randint(0, 100, (5, 4), generator=g).int(),
        "f16": torch.randn(3, 2, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, 2, generator=g).double(),
        "empty": torch.empty(0, 8),
        "scalar": torch.tensor(1.5),
    }
    path = tmp_path / "t.safetensors"
    ht.write_safetensors(path, tensors, metadata={"headkl.k": 4, "note": "x"})
    back = ht.read_safetensors(str(path))
    assert back.pop("__metadata__") == {"headkl.k": "4", "note": "x"}
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    ht.write_safetensors(path, {"x": torch.ones(2)})
    assert ht.read_safetensors(path)["__metadata__"] == {}


def test_views_grad_and_other_layouts_are_copied(tmp_path):
    x = torch.arange(12.0).reshape(3, 4).requires_grad_()
    tensors = {"a": x, "same": x, "t": x.t(), "row": x[1], "col": x[:, 0], "none": x[1:1]}
    path = tmp_path / "v.safetensors"
    ht.write_safetensors(path, tensors)
    back = ht.read_safetensors(path)
    for name, t in tensors.items():
        assert torch.equal(back[name], t.detach()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_written_from_the_host(tmp_path):
    x = torch.randn(4, 3, device="cuda")
    ht.write_safetensors(tmp_path / "c.safetensors", {"x": x.t()})
    assert torch.equal(ht.read_safetensors(tmp_path / "c.safetensors")["x"], x.t().cpu())


def test_read_tensors_outlive_the_file(tmp_path):
    path = tmp_path / "big.safetensors"
    x = torch.randn(1 << 18)
    ht.write_safetensors(path, {"x": x})
    back = ht.read_safetensors(path)
    with open(path, "wb") as f:  # truncated in place: a mapped tensor would fault
        f.write(b"\0" * 8)
    assert torch.equal(back["x"], x)
    back["x"].add_(1)


def test_reads_a_file_as_the_command_writes_it(tmp_path):
    ids = torch.tensor([[3, 1], [0, 2]])
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    meta = {"headkl.format": "1", "headkl.k": "2", "headkl.temperature": "2"}
    path = tmp_path / "teacher.safetensors"
    _raw_file(path, {"probs": ("F32", probs), "ids": ("I64", ids)}, meta)
    back = ht.read_safetensors(path)
    assert back["__metadata__"] == meta
    assert torch.equal(back["ids"], ids) and torch.equal(back["probs"], probs)


def test_writes_the_layout_the_command_reads(tmp_path):
    path = tmp_path / "w.safetensors"
    ht.write_safetensors(path, {"weight": torch.ones(4, 2), "ids": torch.zeros(3, dtype=torch.int32)}, {"k": 1})
    size, header = _header(path)
    assert size % 8 == 0
    assert header.pop("__metadata__") == {"k": "1"}
    assert header["weight"]["dtype"] == "F32" and header["weight"]["shape"] == [4, 2]
    assert header["ids"]["dtype"] == "I32" and header["ids"]["shape"] == [3]
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == os.path.getsize(path) - 8 - size


def test_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        ht.read_safetensors(missing)
    text = tmp_path / "notes.txt"
    text.write_text("not a safetensors file at all\n")
    with pytest.raises(ValueError, match=r"notes\.txt: not a safetensors file"):
        ht.read_safetensors(text)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.safetensors: not a safetensors file"):
        ht.read_safetensors(empty)
    out = tmp_path / "out.safetensors"
    with pytest.raises(TypeError, match=r"out\.safetensors: tensor 'x' is a list"):
        ht.write_safetensors(out, {"x": [1.0, 2.0]})
    with pytest.raises(TypeError, match="tensor name 1 is a int"):
        ht.write_safetensors(out, {1: torch.ones(1)})
    with pytest.raises(ValueError, match=r"out\.safetensors: tensor 'x' is torch\.sparse_coo"):
        ht.write_safetensors(out, {"x": torch.ones(3).to_sparse()})
    with pytest.raises(ValueError, match=r"out\.safetensors: dtype torch\.complex128"):
        ht.write_safetensors(out, {"x": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(OSError, match="nowhere"):
        ht.write_safetensors(tmp_path / "nowhere" / "x.safetensors", {"x": torch.ones(1)})
    assert not out.exists()


def test_without_the_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        ht.read_safetensors(tmp_path / "x.safetensors")
    with pytest.raises(ImportError, match="pip install safetensors"):
        ht.write_safetensors(tmp_path / "x.safetensors", {"x": torch.ones(1)})


def _command():
    """The `headkl` command: $HEADKL_CLI, this checkout's release build, or
    one on the PATH."""
    for c in (os.environ.get("HEADKL_CLI"), os.path.join(ROOT, "target", "release", "headkl"), shutil.which("headkl")):
        if c and os.access(c, os.X_OK) and os.path.isfile(c):
            return c
    pytest.skip("no headkl command (cargo build --release -p headkl-cli, or set HEADKL_CLI)")


def test_the_command_reads_and_writes_the_packages_files(tmp_path):
    cli = _command()
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 8, generator=g)
    teacher, student = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    p = {n: str(tmp_path / f"{n}.safetensors") for n in ("head", "teacher", "student", "top", "again", "loss")}
    ht.write_safetensors(p["head"], {"weight": weight})
    ht.write_safetensors(p["teacher"], {"hidden": teacher})
    ht.write_safetensors(p["student"], {"hidden": student.t().contiguous().t()})

    def run(*args, ok=True):
        r = subprocess.run([cli, "--quiet", *args, "--backend", "reference"], capture_output=True, text=True)
        assert (r.returncode == 0) == ok, r.stderr
        return r

    run("topk", "--head", p["head"], "--hidden", p["teacher"], "-k", "4", "--temperature", "2", "--out", p["top"])
    top = ht.read_safetensors(p["top"])
    meta = top["__metadata__"]
    assert meta["headkl.k"] == "4" and float(meta["headkl.temperature"]) == 2.0 and "headkl.head.hash" in meta
    expect = ht.topk(teacher, weight, 4, temperature=2.0, backend="reference")
    assert torch.equal(top["ids"], expect.ids)
    torch.testing.assert_close(top["probs"], expect.values.float())

    # Rewritten by the package with its metadata: the command's teacher
    # check still sees the head and the temperature it was made with.
    ht.write_safetensors(p["again"], {"ids": top["ids"], "probs": top["probs"]}, meta)
    run("loss", "--head", p["head"], "--hidden", p["student"], "--teacher", p["again"], "--temperature", "2", "--out", p["loss"])
    bad = run("loss", "--head", p["head"], "--hidden", p["student"], "--teacher", p["again"], "--out", p["loss"], ok=False)
    assert "temperature" in bad.stderr
    out = ht.read_safetensors(p["loss"])
    loss = ht.HeadKLLoss(weight, temperature=2.0, backend="reference")(student, top["ids"], top["probs"])
    assert abs(float(out["__metadata__"]["headkl.mean"]) - loss.item()) < 1e-4 * max(1.0, abs(loss.item()))
    assert out["loss"].shape == (6,)
