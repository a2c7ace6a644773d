"""The caches made at first use heal and race safely (issue 62, items 3 and 4): the int8 weights,
the draft vocabularies and the presets' assembled and dequantized files.

A damaged entry (a garbled header, flipped bits, NaN scales, a changed vocabulary, a changed
dequantized file) is made again with a line on stderr, never loaded (it gave a traceback, or
wrong tokens without a word); a cache folder that cannot be written leaves what can be computed
in memory, said once (it gave an OSError traceback); two processes doing the same first use at
once both succeed with the same result, made once (one died on the other's `.partial`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from speculative import load_model
from speculative.core import disk_cache
from speculative.models import presets
from speculative.proposers.vocab import corpus_vocab
from tests.test_int8 import llama_checkpoint  # noqa: F401 (a fixture)
from tests.test_presets import fake_chunks

IDS = [[1, 2, 3, 4, 5, 6, 7, 8]]
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def checkpoint(llama_checkpoint):
    """A transformers Llama checkpoint that loads into the built-in decoder (no tokenizer, so
    quantized without smoothing)."""
    return llama_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(torch.tensor(IDS), model.new_state(1, 16))


@pytest.fixture(scope="module")
def fresh(checkpoint, tmp_path_factory):
    """The int8 model's logits as a fresh build in a cache of its own gives them."""
    previous = os.environ.get("SPECULATIVE_CACHE")
    os.environ["SPECULATIVE_CACHE"] = str(tmp_path_factory.mktemp("fresh"))
    try:
        return logits(load_model(checkpoint, dtype="int8"))
    finally:
        os.environ.pop("SPECULATIVE_CACHE") if previous is None else os.environ.update(SPECULATIVE_CACHE=previous)


def tensors_at(file: Path) -> tuple[dict, int]:
    """A safetensors file's header ({name: dtype, shape, data_offsets}) and where its data starts."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), 8 + length


def damage_int8(file: Path, kind: str) -> None:
    data = bytearray(file.read_bytes())
    header, start = tensors_at(file)
    if kind == "header":  # same size, no longer JSON
        data[8:24] = b"#" * 16
    elif kind == "weights":  # 2,000 bits flipped in one layer's int8 weights
        name = next(name for name in header if name.endswith(".qweight"))
        begin, end = header[name]["data_offsets"]
        for i in torch.randint(start + begin, start + end, (2000,), generator=torch.Generator().manual_seed(0)):
            data[int(i)] ^= 1 << int(i) % 8
    else:  # a layer's float32 scales turned NaN and huge
        name = next(name for name in header if name.endswith(".scale"))
        begin, end = header[name]["data_offsets"]
        count = min(100, (end - begin) // 4)
        values = torch.tensor([float("nan"), 3e38] * count)[:count]
        data[start + begin:start + begin + 4 * count] = values.numpy().tobytes()
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["header", "weights", "scale"])
def test_a_damaged_int8_cache_is_quantized_again_with_a_message(checkpoint, cache, fresh, capsys, kind):
    import speculative.models.int8 as int8

    load_model(checkpoint, dtype="int8")
    load_model(checkpoint, dtype="int8")  # found whole, so stamped: the damage below must still be seen
    [entry] = [p for p in (cache / "int8").iterdir() if p.is_dir()]
    assert (entry / (int8.MANIFEST + disk_cache.CHECKED)).is_file()
    damage_int8(entry / "layers.0.safetensors", kind)
    capsys.readouterr()
    healed = load_model(checkpoint, dtype="int8")
    said = capsys.readouterr().err
    assert torch.equal(logits(healed), fresh)  # (loaded as it was, it gave other logits)
    assert f"the int8 cache {entry} is damaged (layers.0.safetensors does not match the SHA-256" in said, said
    assert "quantizing llama again" in said
    again = load_model(checkpoint, dtype="int8")  # healed on disk too: read as it is, silently
    assert "damaged" not in capsys.readouterr().err and torch.equal(logits(again), fresh)


def test_an_int8_cache_an_older_version_wrote_is_kept_and_its_checksums_recorded(checkpoint, cache, fresh, capsys,
                                                                                  monkeypatch):
    """An older version's manifest held sizes only: a cache whose sizes match is not quantized
    again (minutes for a 1.5B model) but gets its checksums; one whose sizes differ is."""
    import speculative.models.int8 as int8

    load_model(checkpoint, dtype="int8")
    [entry] = [p for p in (cache / "int8").iterdir() if p.is_dir()]
    sizes = {p.name: p.stat().st_size for p in entry.iterdir() if p.name.endswith((".safetensors", ".json"))
             and p.name != int8.MANIFEST}
    (entry / int8.MANIFEST).write_text(json.dumps(sizes))  # as the older version wrote it
    for stamp in entry.glob("*" + disk_cache.CHECKED):
        stamp.unlink()
    quantize = int8._quantize_and_write
    monkeypatch.setattr(int8, "_quantize_and_write", lambda *a: pytest.fail("quantized again"))
    capsys.readouterr()
    assert torch.equal(logits(load_model(checkpoint, dtype="int8")), fresh)
    assert "an older version recorded sizes only" in capsys.readouterr().err
    assert disk_cache.damage(entry, int8.MANIFEST) is None
    monkeypatch.setattr(int8, "_quantize_and_write", quantize)
    sizes["layers.0.safetensors"] += 1
    (entry / int8.MANIFEST).write_text(json.dumps(sizes))
    assert torch.equal(logits(load_model(checkpoint, dtype="int8")), fresh)
    assert "quantizing llama again" in capsys.readouterr().err


def test_a_cache_found_whole_is_hashed_again_only_once_a_file_changed(tmp_path, monkeypatch):
    """Hashing a 7 GB preset at every start would cost seconds: a stamp of what was found whole
    skips it, and any write to a file (even with its mtime set back) voids the stamp."""
    folder, gguf = tmp_path / "entry", tmp_path / "model.gguf"
    folder.mkdir()
    for name in "ab":
        (folder / f"{name}.bin").write_bytes(name.encode() * 4096)
    disk_cache.record(folder, "manifest.json")
    gguf.write_bytes(b"GGUF" * 4096)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    hashed, hash_file = [], disk_cache.sha256
    monkeypatch.setattr(disk_cache, "sha256", lambda path: hashed.append(path.name) or hash_file(path))
    checks = [disk_cache.damage(folder, "manifest.json") for _ in range(3)]
    assert checks == [None] * 3 and sorted(hashed) == ["a.bin", "b.bin"]  # hashed by the first check only
    assert [disk_cache.has_sha256(gguf, digest) for _ in range(3)] == [True] * 3 and hashed.count("model.gguf") == 1
    for file in (folder / "b.bin", gguf):
        stat, data = file.stat(), bytearray(file.read_bytes())
        data[100] ^= 1
        file.write_bytes(bytes(data))
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as a copy that keeps times would
    assert disk_cache.damage(folder, "manifest.json") == "b.bin does not match the SHA-256 recorded when it was written"
    assert not disk_cache.has_sha256(gguf, digest)
    assert not disk_cache.has_sha256(gguf, "0" * 64)  # another expected file: hashed again, not taken from the stamp


@contextmanager
def read_only(folder: Path):
    """`folder` read-only: by its mode, or where modes do not bind (root), made immutable."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    immutable = os.access(folder, os.W_OK) and shutil.which("chattr") is not None
    if immutable:
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        if os.access(folder, os.W_OK) and not immutable:
            pytest.skip("no way to make a folder read-only here")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_an_int8_cache_folder_that_cannot_be_written_keeps_the_model_in_memory_and_says_so_once(
        checkpoint, cache, fresh, capsys):
    with read_only(cache):
        models = [load_model(checkpoint, dtype="int8") for _ in range(2)]
        said = capsys.readouterr().err
    assert said.count(f"the cache folder {cache / 'int8'} cannot be written") == 1, said
    assert "quantized in memory" in said and "SPECULATIVE_CACHE" in said
    assert all(torch.equal(logits(model), fresh) for model in models)
    assert not list(cache.iterdir())


def test_an_int8_cache_on_a_disk_that_fills_keeps_the_model_in_memory_and_leaves_nothing(checkpoint, cache, fresh):
    """safetensors' failed writes came as its own error, not an OSError: a traceback, and a partial folder left.
    A file-size limit stands in for the full disk."""
    code = f"""
import hashlib, resource, signal, torch
from speculative import load_model
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
model = load_model({str(checkpoint)!r}, dtype="int8")
with torch.inference_mode():
    out = model.forward(torch.tensor({IDS!r}), model.new_state(1, 16))
print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SPECULATIVE_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(fresh.numpy().tobytes()).hexdigest()
    assert "could not be written" in done.stderr and "in memory only" in done.stderr, done.stderr
    assert not [path for path in (cache / "int8").iterdir() if path.suffix != ".lock"]


READY = """
import os, sys, time
from pathlib import Path


def ready():
    \"\"\"Wait for the other process: both start the first use at once.\"\"\"
    Path(sys.argv[1], str(os.getpid())).touch()
    while len(os.listdir(sys.argv[1])) < 2:
        time.sleep(0.001)
"""


def at_once(code: str, tmp_path: Path, *args: str, **env: str) -> list[subprocess.CompletedProcess]:
    """`code` run by two processes, which call ready() to wait for each other."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    script = READY + textwrap.dedent(code)
    runs = [subprocess.Popen([sys.executable, "-c", script, str(barrier), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, **env}) for _ in range(2)]
    return [subprocess.CompletedProcess(run.args, run.wait(timeout=600), *run.communicate()) for run in runs]


def test_two_processes_making_the_same_int8_cache_at_once_both_succeed_and_quantize_once(checkpoint, tmp_path):
    code = """
        import hashlib, torch
        from speculative import load_model
        ready()
        model = load_model(sys.argv[2], dtype="int8")
        with torch.inference_mode():
            out = model.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), model.new_state(1, 16))
        print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
    """
    cache = tmp_path / "cache"
    runs = at_once(code, tmp_path, str(checkpoint), SPECULATIVE_CACHE=str(cache))
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout
    assert sum("quantizing to int8" in run.stderr for run in runs) == 1  # the other waited, then read it
    assert [p.suffix for p in (cache / "int8").iterdir()].count("") == 1
    assert not list((cache / "int8").glob("*partial*"))


class CharTokenizer:
    """Characters as token ids: enough for counting."""

    def encode(self, text):
        return [ord(c) % 64 for c in text]

    def vocab(self):
        return {chr(i): i for i in range(64)}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog; " * 2000)
    return path


def digit_changed(text: str) -> str:
    """One id changed, still valid JSON (a bit flipped in a digit)."""
    at = next(i for i, c in enumerate(text) if c.isdigit())
    return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:]


@pytest.mark.parametrize("damage", [lambda text: text[:len(text) // 2], digit_changed], ids=["truncated", "id changed"])
def test_a_damaged_vocabulary_is_counted_again_with_a_message(tmp_path, corpus, capsys, damage):
    first = corpus_vocab(CharTokenizer(), 12, str(corpus), cache=tmp_path / "vocab")
    [file] = (tmp_path / "vocab").glob("*.json")
    file.write_text(damage(file.read_text()))
    capsys.readouterr()
    again = corpus_vocab(CharTokenizer(), 12, str(corpus), cache=tmp_path / "vocab")
    said = capsys.readouterr().err
    assert again.tolist() == first.tolist()  # (read as it was: a traceback, or other ids)
    assert f"the draft vocabulary {file} is damaged" in said and "counting it again" in said, said
    corpus_vocab(CharTokenizer(), 12, str(corpus), cache=tmp_path / "vocab")
    assert "damaged" not in capsys.readouterr().err


def test_a_vocabulary_folder_that_cannot_be_written_is_counted_in_memory_and_said_once(tmp_path, corpus, capsys):
    expected = corpus_vocab(CharTokenizer(), 12, str(corpus), cache=tmp_path / "writable")
    with read_only(tmp_path / "vocab") as folder:
        counted = [corpus_vocab(CharTokenizer(), 12, str(corpus), cache=folder) for _ in range(2)]
        said = capsys.readouterr().err
    assert said.count(f"the cache folder {folder} cannot be written") == 1, said
    assert all(ids.tolist() == expected.tolist() for ids in counted)
    assert not list(folder.iterdir())


def test_two_processes_counting_the_same_vocabulary_at_once_both_succeed_and_count_once(tmp_path, corpus):
    code = f"""
        sys.path.insert(0, {str(REPO)!r})
        from speculative.proposers import vocab
        from tests.test_cache_faults import CharTokenizer
        counting = vocab.frequent_tokens
        vocab.frequent_tokens = lambda *a: print("counted", file=sys.stderr) or counting(*a)
        ready()
        print(vocab.corpus_vocab(CharTokenizer(), 12, sys.argv[2], cache=Path(sys.argv[3])).tolist())
    """
    runs = at_once(code, tmp_path, str(corpus), str(tmp_path / "vocab"))
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout
    assert sum(run.stderr.count("counted") for run in runs) == 1  # the other waited, then read it
    assert not list((tmp_path / "vocab").glob("*partial*"))


# A split of a fake GGUF, large enough that assembling it takes a while (the window of a race).
PARTS = [b"GGUF" + bytes(range(256)) * (1 << 15), bytes(range(255, -1, -1)) * (1 << 15), b"tail of the file"]


@pytest.fixture
def split(tmp_path, monkeypatch):
    """Three fake chunk packages on sys.path (as in test_presets.py), and the spec of their file."""
    spec, root, _ = fake_chunks(PARTS, tmp_path, monkeypatch)
    return spec, root


def convert(gguf: Path, out: Path) -> None:
    """Stands in for transformers' reading of a GGUF file (the real one, with the real Gemma,
    is tested elsewhere): what the cache holds is what is under test here."""
    (out / "model.safetensors").write_bytes(hashlib.sha256(gguf.read_bytes()).digest() * 1000)


def test_a_damaged_dequantized_preset_is_made_again_with_a_message(split, monkeypatch, capsys):
    spec, _ = split
    converted = []
    monkeypatch.setattr(presets, "convert_gguf", lambda gguf, out: converted.append(out) or convert(gguf, out))
    target = presets.chunked_directory(spec)
    whole = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(b"X" + whole[1:])  # same size
    capsys.readouterr()
    assert presets.chunked_directory(spec) == target and len(converted) == 2
    said = capsys.readouterr().err
    assert f"{target} is damaged (model.safetensors does not match the SHA-256" in said, said
    assert (target / "model.safetensors").read_bytes() == whole
    assert presets.chunked_directory(spec) == target and len(converted) == 2


@pytest.mark.parametrize("before", ["nothing", "made, then deleted"])
def test_a_preset_cache_folder_that_cannot_be_written_is_named_in_the_error(split, monkeypatch, tmp_path, before):
    spec, _ = split
    monkeypatch.setattr(presets, "convert_gguf", convert)
    if before != "nothing":  # (its lock files stay: they open in a read-only folder)
        shutil.rmtree(presets.chunked_directory(spec))
    with read_only(tmp_path / "cache"), pytest.raises(OSError, match=f"the cache folder {tmp_path / 'cache'} cannot "
                                                                    "be written .*set SPECULATIVE_CACHE"):
        presets.chunked_directory(spec)


def test_a_preset_made_by_an_older_version_is_kept_and_its_checksums_recorded(split, monkeypatch, tmp_path, capsys):
    """Older versions recorded sizes only: a directory whose sizes match is not made again (minutes), its
    checksums are recorded; where its folder cannot be written, it is taken as it is, said once."""
    spec, _ = split
    converted = []
    monkeypatch.setattr(presets, "convert_gguf", lambda gguf, out: converted.append(out) or convert(gguf, out))
    target = presets.chunked_directory(spec)
    manifest = target / presets.MANIFEST
    older = json.dumps({name: entry["size"] for name, entry in json.loads(manifest.read_text()).items()})
    manifest.write_text(older)
    capsys.readouterr()
    with read_only(tmp_path / "cache"):
        assert [presets.chunked_directory(spec) for _ in range(2)] == [target] * 2
        said = capsys.readouterr().err
    assert said.count(f"{target} was made by an older version, which recorded no checksums") == 1, said
    assert manifest.read_text() == older
    assert presets.chunked_directory(spec) == target and len(converted) == 1
    assert f"recording the SHA-256 of every file of {target}" in capsys.readouterr().err
    assert presets.complete(target)


def test_two_processes_making_the_same_preset_at_once_both_succeed_and_make_it_once(split, tmp_path):
    spec, root = split
    code = f"""
        import hashlib
        sys.path.insert(0, {str(root)!r})
        sys.path.insert(0, {str(REPO)!r})
        from speculative.models import presets
        from tests.test_cache_faults import convert
        presets.convert_gguf = lambda gguf, out: print("converted", file=sys.stderr) or convert(gguf, out)
        spec = presets.ChunkedGGUF("fake-model", {spec.modules!r}, {spec.size}, {spec.sha256!r}, "fake")
        ready()
        target = presets.chunked_directory(spec)
        print(hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest())
    """
    runs = at_once(code, tmp_path, SPECULATIVE_CACHE=os.environ["SPECULATIVE_CACHE"])
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout
    assert sum(run.stderr.count("converted") for run in runs) == 1  # the other waited, then took it
    assert not list(presets.cache_root().rglob("*partial*"))


def test_two_processes_assembling_the_same_gguf_at_once_both_get_it_whole_and_assemble_once(split, tmp_path):
    spec, root = split
    code = f"""
        import hashlib
        from pathlib import Path
        sys.path.insert(0, {str(root)!r})
        from speculative.models import presets
        concatenate = presets._concatenate
        presets._concatenate = lambda *args: print("assembled", file=sys.stderr) or concatenate(*args)
        spec = presets.ChunkedGGUF("fake-model", {spec.modules!r}, {spec.size}, {spec.sha256!r}, "fake")
        ready()
        out = presets.assemble(spec, Path(sys.argv[2]), progress=False)
        print(hashlib.sha256(out.read_bytes()).hexdigest())
    """
    out = tmp_path / "gguf" / "fake.gguf"
    runs = at_once(code, tmp_path, str(out))
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout.strip() == runs[1].stdout.strip() == spec.sha256
    assert sum(run.stderr.count("assembled") for run in runs) == 1  # the other waited, then took it
    assert not list(out.parent.glob("*partial*"))
