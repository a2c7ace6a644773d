"""The layer matrices of a GGUF file on the block kernels, by width and instruction set: what a
forward's linear products cost (no attention, no output layer), to choose and tune kernels.

    python dev/kernel_widths.py                                   # Qwen2.5-Coder 1.5B, every ISA this CPU runs
    python dev/kernel_widths.py qwen2.5-coder-0.5b avx2,avx512_vnni

2 threads; every ISA and width in turn, 7 rounds, medians of the last 5; width 1 in
milliseconds, the others in width-1 units of the same ISA.
"""

import statistics
import sys
import time

import torch

from speculative.models import presets
from speculative.models.int8_kernel import compiled_ops
from speculative.models.kquant import KQuantLinear, read_gguf_tensors

WIDTHS, ROUNDS = [1, 2, 5, 8, 9, 17], 7


def layers(name: str) -> list[KQuantLinear]:
    gguf = presets.cache_root() / "gguf" / f"{name}.gguf"
    if not gguf.is_file():
        presets.assemble(presets.CHUNKED[name], gguf)
    tensors = read_gguf_tensors(gguf)
    return [KQuantLinear([(tensor.data, tensor.tensor_type)], int(tensor.shape[0]))
            for key, tensor in tensors.items()
            if key.startswith("blk.") and len(tensor.shape) == 2 and tensor.data is not None]


def main(name: str, isas: list[str] | None) -> None:
    torch.set_num_threads(2)
    ops = compiled_ops(required=True)
    isas = isas or [isa for isa in ("plain", "avx2", "avx_vnni", "avx512_vnni") if runs(ops, isa)][1:]
    model = layers(name)
    inputs = {width: {layer.in_features: torch.randn(width, layer.in_features) for layer in model} for width in WIDTHS}
    times = {(isa, width): [] for isa in isas for width in WIDTHS}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for isa in isas:
                for layer in model:
                    layer.isa = isa
                for width in WIDTHS:
                    started = time.perf_counter()
                    for layer in model:
                        layer(inputs[width][layer.in_features])
                    times[(isa, width)].append(time.perf_counter() - started)
    print(f"{name}: {len(model)} matrices, ISA ceiling {ops.isa()}")
    for isa in isas:
        one = statistics.median(times[(isa, 1)][2:])
        print(f"{isa:12s} width 1: {one * 1e3:6.1f} ms; " + ", ".join(
            f"{width}: {statistics.median(times[(isa, width)][2:]) / one:.2f}" for width in WIDTHS[1:]))


def runs(ops, isa: str) -> bool:
    try:
        ops.q32_linear(torch.zeros(1, 32), torch.zeros(1, 1, 4 * 64 + 64 + 32, dtype=torch.uint8), 6, None, 16, isa)  # Q5_0
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b",
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
