"""Chunked-GGUF presets: assembly from PyPI-style chunk packages, checked, never half-written.

A tiny fake split is made in each test (packages `fakechunk_partN` holding data/partNN.bin
on a temporary sys.path); the real 1 GB files are never touched here.
"""

import hashlib

import pytest

from speculative.models import presets

PARTS = [b"GGUF" + bytes(range(7)) * 9, bytes(range(50, 120)), b"tail of the file"]


@pytest.fixture
def split(tmp_path, monkeypatch):
    """Three fake chunk packages on sys.path, and the spec that describes them."""
    return fake_chunks(PARTS, tmp_path, monkeypatch)


def fake_chunks(parts: list[bytes], tmp_path, monkeypatch):
    """Chunk packages holding `parts` on sys.path, the cache in tmp_path: (spec, root, whole)."""
    root = tmp_path / "site"
    for i, data in enumerate(parts, 1):
        package = root / f"fakechunk_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    whole = b"".join(parts)
    spec = presets.ChunkedGGUF("fake-model", tuple(f"fakechunk_part{i}" for i in range(1, 4)), len(whole),
                               hashlib.sha256(whole).hexdigest(), "fake")
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    return spec, root, whole


def test_parts_assemble_in_order(split, tmp_path):
    spec, _, whole = split
    out = presets.assemble(spec, tmp_path / "cache" / "fake.gguf", progress=False)
    assert out.read_bytes() == whole and out.read_bytes()[:4] == b"GGUF"
    assert not list(out.parent.glob("*.partial"))


def test_truncated_or_corrupt_assembly_is_rebuilt(split, tmp_path):
    spec, _, whole = split
    out = tmp_path / "cache" / "fake.gguf"
    presets.assemble(spec, out, progress=False)
    out.write_bytes(whole[:-5])  # truncated, e.g. an interrupted copy
    assert presets.assemble(spec, out, progress=False).read_bytes() == whole
    out.write_bytes(whole[:10] + b"X" + whole[11:])  # same size, one byte changed
    assert presets.assemble(spec, out, progress=False).read_bytes() == whole


def test_a_corrupt_part_is_refused_and_nothing_is_left(split, tmp_path):
    spec, root, _ = split
    part = root / "fakechunk_part2" / "data" / "part02.bin"
    part.write_bytes(b"Y" + part.read_bytes()[1:])
    out = tmp_path / "cache" / "fake.gguf"
    with pytest.raises(ValueError, match="the parts of fake-model are corrupt: SHA-256 .* expected .*pip install "
                                         "--force-reinstall 'speculative\\[fake\\]'"):
        presets.assemble(spec, out, progress=False)
    assert not out.exists() and not list(out.parent.glob("*.partial"))


def test_a_truncated_part_is_refused(split, tmp_path):
    spec, root, _ = split
    part = root / "fakechunk_part3" / "data" / "part03.bin"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ValueError, match=f"hold {spec.size - 1} bytes, expected {spec.size}"):
        presets.assemble(spec, tmp_path / "cache" / "fake.gguf", progress=False)


def test_a_missing_extra_names_the_pip_command(split, monkeypatch):
    spec, _, _ = split
    missing = presets.ChunkedGGUF("fake-model", spec.modules + ("fakechunk_part9",), spec.size, spec.sha256, "fake")
    with pytest.raises(ValueError, match="needs the package fakechunk-part9 .*pip install 'speculative\\[fake\\]'"):
        missing.chunk_paths()
    from speculative.models.loading import load_model

    monkeypatch.setitem(presets.CHUNKED, "fake-model", missing)
    with pytest.raises(ValueError, match="preset 'fake-model' needs the package fakechunk-part9"):
        load_model("fake-model")


def test_dequantized_directory_is_rebuilt_when_incomplete(split, monkeypatch):
    spec, _, whole = split
    converted = []

    def fake_convert(gguf, out):  # transformers' reading of GGUF is exercised with the real Gemma elsewhere
        assert gguf.read_bytes() == whole
        (out / "model.safetensors").write_bytes(b"weights")
        converted.append(out)

    monkeypatch.setattr(presets, "convert_gguf", fake_convert)
    first = presets.chunked_directory(spec)
    assert presets.complete(first) and len(converted) == 1
    assert not first.with_name(first.name + ".partial").exists()
    assert presets.chunked_directory(spec) == first and len(converted) == 1  # whole: loaded as it is
    (first / "model.safetensors").write_bytes(b"weig")  # damaged
    assert not presets.complete(first)
    assert presets.chunked_directory(spec) == first and len(converted) == 2 and presets.complete(first)


def test_an_interrupted_conversion_leaves_no_directory_to_load(split, monkeypatch):
    spec, _, _ = split

    def crash(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(presets, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        presets.chunked_directory(spec)
    assert not (presets.cache_root() / spec.name).exists()
