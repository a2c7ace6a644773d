"""Reading a prompt without logits (the last layer writes only its keys and values) against
reading it with the last layer's outputs, alternating in one process (2 threads).

    python dev/prompt_reading.py gemma-3-270m float32 1537
    python dev/prompt_reading.py gemma-3-270m bfloat16 1537 transformers   # its transformers module
    python dev/prompt_reading.py qwen2.5-coder-1.5b auto 300

Random token ids; 6 pairs after one of each, the order alternating; medians and each pair's ratio.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from lookup_vs_transformers import hf_module  # noqa: E402

from speculative import load_model  # noqa: E402


def readers(name: str, dtype: str, transformers: bool):
    """read(ids, outputs): a prompt read with the last layer's outputs, or without them."""
    if transformers:  # Gemma 3 270M's transformers module, as the lookup benchmark loads it
        if name != "gemma-3-270m":
            raise SystemExit("the transformers module is Gemma 3 270M's (benchmarks/lookup_vs_transformers.py)")
        model = hf_module(dtype)

        def read(ids, outputs):
            model._cache_only = not outputs
            model.forward(ids, model.new_state(1), keep_logits=False)
        return read
    model = load_model(name, dtype=dtype)

    def read(ids, outputs):
        state = model.new_state(1, ids.shape[1] + 8)
        if outputs:
            model.run_blocks(model.embed(ids), state)
        else:
            model.forward(ids, state, keep_logits=False)
    return read


def main(name: str, dtype: str, length: int, transformers: bool) -> None:
    torch.set_num_threads(2)
    read = readers(name, dtype, transformers)
    ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(0))
    seconds = {True: [], False: []}
    with torch.inference_mode():
        read(ids, True), read(ids, False)
        for pair in range(6):
            for outputs in ((True, False) if pair % 2 else (False, True)):
                start = time.perf_counter()
                read(ids, outputs)
                seconds[outputs].append(time.perf_counter() - start)
    full, bare = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"{name} {dtype}{' (transformers module)' if transformers else ''}, {length} tokens: with the last "
          f"layer's outputs {full:.3f} s, without {bare:.3f} s: {full / bare:.3f}x; pairs "
          f"{[round(a / b, 3) for a, b in zip(seconds[True], seconds[False])]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "transformers")
