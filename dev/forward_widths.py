"""A forward's cost by width, per precision, after 300 tokens of context: what `auto` chooses from.

    python dev/forward_widths.py target bfloat16,int8,gguf   # Qwen2.5-Coder 1.5B
    python dev/forward_widths.py draft bfloat16,int8,gguf    # its 0.5B draft, as load_draft loads it
    python dev/forward_widths.py gemma-3-270m bfloat16,int8,float32

2 threads; every precision and width in turn, 7 rounds, medians of the last 5; width 1 in
milliseconds, the others in one-token forwards.
"""

import statistics
import sys
import time

import torch

from speculative import load_model
from speculative.models.base import screens_argmax
from speculative.models.loading import load_draft

WIDTHS, CONTEXT, ROUNDS = [1, 2, 5, 9, 17], 300, 7


def load(which: str, dtype: str):
    if which == "target":
        return load_model("qwen2.5-coder-1.5b", dtype=dtype)
    if which == "draft":
        return load_draft("qwen2.5-coder-0.5b", dtype=dtype)
    return load_model(which, dtype=dtype)


def main(which: str, dtypes: list[str]) -> None:
    torch.set_num_threads(2)
    models = {dtype: load(which, dtype) for dtype in dtypes}
    states = {}
    for dtype, model in models.items():
        states[dtype] = model.new_state(1, 1024)
        model.forward(torch.randint(100, 5000, (1, CONTEXT)), states[dtype], keep_logits=False)
    times = {(dtype, width): [] for dtype in models for width in WIDTHS}
    token = torch.tensor([[1234]])
    for _ in range(ROUNDS):
        for dtype, model in models.items():
            greedy = {"argmax_rows": [True]} if screens_argmax(model) else {}
            for width in WIDTHS:
                started = time.perf_counter()
                model.forward(token.repeat(1, width), states[dtype], **greedy)
                times[(dtype, width)].append(time.perf_counter() - started)
                model.rollback(states[dtype], [CONTEXT])
    for dtype in models:
        one = statistics.median(times[(dtype, 1)][2:])
        print(f"{dtype:10s} width 1: {one * 1e3:6.1f} ms; " + ", ".join(
            f"{width}: {statistics.median(times[(dtype, width)][2:]) / one:.2f}" for width in WIDTHS[1:]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target",
         (sys.argv[2] if len(sys.argv) > 2 else "bfloat16,int8,gguf").split(","))
