"""Which instruction set the compiled kernels (`csrc/`) run: the best this CPU has, or a lower
one named by SPECULATIVE_ISA, so that one machine runs another CPU class's code: to test every
path on any machine that can execute it, and to measure the AVX2 path on a CPU that has more.

Levels, lowest first (names as /proc/cpuinfo spells the flags): `plain` (C++), `avx2`,
`avx_vnni` (AVX2 with VEX-encoded VNNI: Intel client CPUs from Alder Lake, Zen 5),
`avx512_vnni` (with AVX512BW: Zen 4 and 5, Xeons from Cascade Lake), `amx` (Xeons from
Sapphire Rapids; the int8 product only). Under a ceiling, `auto` precision decisions see the
CPU flags of that class only (`visible_flags`), and PyTorch's own kernels are capped too
(`cap_torch`: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, where not set),
so that the whole process behaves as on such a CPU, up to its memory and clock.
"""

from __future__ import annotations

import contextlib
import functools
import os

LEVELS = ("plain", "avx2", "avx_vnni", "avx512_vnni", "amx")
# The CPU flags each level needs.
NEEDS = {"plain": (), "avx2": ("avx2", "f16c"), "avx_vnni": ("avx2", "f16c", "avx_vnni"), "avx512_vnni": ("avx512_vnni", "avx512bw"),
         "amx": ("amx_int8", "amx_tile")}
# Flags that only CPUs above a level have (by prefix): hidden under that ceiling.
ABOVE = {"plain": ("avx", "fma", "f16c", "amx"), "avx2": ("avx512", "avx_vnni", "amx"), "avx_vnni": ("avx512", "amx"),
         "avx512_vnni": ("amx",), "amx": ()}
# PyTorch's own caps for each ceiling (ATen's dispatch, oneDNN, MKL).
TORCH_CAPS = {"plain": ("default", "SSE41", "SSE4_2"), "avx2": ("avx2", "AVX2", "AVX2"),
              "avx_vnni": ("avx2", "AVX2_VNNI", "AVX2"), "avx512_vnni": ("avx512", "AVX512_CORE_VNNI", "AVX512")}

_forced: list[str] = []  # the ceilings of `forced`, innermost last


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runs(level: str, flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return all(flag in flags for flag in NEEDS[level])


def runnable(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU runs, lowest first."""
    return [level for level in LEVELS if runs(level, flags)]


def check(level: str, source: str = "SPECULATIVE_ISA") -> str:
    """`level` if it names a level this CPU runs; else a ValueError saying what is allowed."""
    if level not in LEVELS:
        raise ValueError(f"{source}={level!r} is not an instruction set; allowed: {', '.join(LEVELS)}")
    if not runs(level):
        raise ValueError(f"{source}={level}: this CPU lacks {', '.join(f for f in NEEDS[level] if f not in cpu_flags())}; "
                         f"it runs {', '.join(runnable())}")
    return level


def ceiling() -> str:
    """The highest level the kernels may use: `forced`, else SPECULATIVE_ISA, else this CPU's best."""
    if _forced:
        return _forced[-1]
    named = os.environ.get("SPECULATIVE_ISA", "").strip()
    return check(named) if named else runnable()[-1]


def visible_flags() -> frozenset[str]:
    """The CPU's flags as a CPU of the ceiling's class would show them (what `auto` decides from)."""
    hidden = ABOVE[ceiling()]
    return frozenset(flag for flag in cpu_flags() if not flag.startswith(hidden))


def apply(ops) -> None:
    """Sets the compiled kernels' ceiling (torch.ops.speculative_kernels) to `ceiling()`."""
    ops.set_isa(ceiling())


def cap_torch() -> None:
    """Caps PyTorch's own kernels at SPECULATIVE_ISA where it is set and the caps are not: it
    takes effect if no PyTorch kernel has run yet in this process (at `import speculative`)."""
    named = os.environ.get("SPECULATIVE_ISA", "").strip()
    if named in TORCH_CAPS and runs(named):
        for variable, value in zip(("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"),
                                   TORCH_CAPS[named]):
            os.environ.setdefault(variable, value)


@contextlib.contextmanager
def forced(level: str):
    """Runs the compiled kernels at `level` (which this CPU must run) within the block, and
    `auto` decisions see its flags (tests; PyTorch's own kernels are not capped)."""
    from .int8_kernel import _load

    _forced.append(check(level, "forced"))
    ops = _load()[0]
    try:
        if ops is not None:
            apply(ops)
        yield level
    finally:
        _forced.pop()
        if ops is not None:
            apply(ops)
