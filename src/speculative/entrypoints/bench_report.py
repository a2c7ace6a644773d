"""The benchmark's report for people: the machine, a table with its legend, a plot."""

from __future__ import annotations

import os
import platform

import torch


def machine() -> str:
    """The CPU (its name, and the generation its family and model tell), the instruction sets
    the kernels run at (SPECULATIVE_ISA where it forces a lower one), cores and torch: figures
    hold for one CPU class, so every table names it."""
    from ..models import isa

    info = cpu_info()
    cpu = info.get("model name") or platform.processor() or platform.machine()
    generation = cpu_generation(info)
    forced = " forced by SPECULATIVE_ISA" if os.environ.get("SPECULATIVE_ISA") else ""
    classes = [f"kernels {isa.ceiling()}{forced}"] + [name for flag, name in (
        ("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in isa.visible_flags()]
    cpu += f" ({', '.join(([generation] if generation else []) + classes)})"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def cpu_info() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo (empty where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_generation(info: dict[str, str]) -> str:
    """AMD's Zen generation from the CPU family and model; 'family F model M' for others."""
    try:
        family, model = int(info["cpu family"]), int(info["model"])
    except (KeyError, ValueError):
        return ""
    if info.get("vendor_id") == "AuthenticAMD":
        if family == 23:
            return "Zen 2" if model >= 0x30 else "Zen 1"
        if family == 25:
            return "Zen 4" if 0x10 <= model < 0x20 or 0x60 <= model < 0x80 or 0xA0 <= model < 0xB0 else "Zen 3"
        if family == 26:
            return "Zen 5"
    return f"family {family} model {model}"


def cpu_flags_words() -> str:
    """The CPU flags that choose kernels, for a benchmark's log."""
    from ..models import isa

    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8",
              "amx_bf16")
    return " ".join(flag for flag in wanted if flag in isa.cpu_flags()) or "none of the x86 vector flags"


def identical_words(method: dict, prompts: int) -> str:
    """yes, NO (with how many prompts' outputs are equal, where recorded), or - (not compared)."""
    if method["identical"] is None:
        return "-"
    same = method.get("identical_prompts")
    return "yes" if method["identical"] else "NO" if same is None else f"NO ({same}/{prompts})"


# What the columns mean (the command prints it under the table).
LEGEND = ("speedup: tokens/s over autoregressive, the median of same-round ratios (per prompt: its median over "
          "prompts); predicted: (1 - a^(K+1)) / ((1 - a)(K c + v)) from the measured a, c and v; alpha: accepted "
          "/ drafted; judged: accepted / drafted tokens that the target judged; tau: tokens per target forward; "
          "time %: decoding time drafting / verifying / elsewhere. Adaptive methods plan from measured timings: "
          "their alpha and tau change from run to run, their greedy output never.")


def table(report: dict, width: int = 100, legend: bool = False) -> str:
    """The results as a table for people (rich) in `width` columns, as plain text (long
    method names wrap), with the LEGEND under it if asked."""
    import textwrap

    from rich import box
    from rich.console import Console
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    grid.add_column("method", min_width=16)
    for column in ("tok/s", "speedup", "per\nprompt", "predicted", "alpha", "judged", "tau", "time %\nd/v/o",
                   "peak\nMB", "identical"):
        grid.add_column(column, justify="right", no_wrap=True)

    def fmt(value, pattern="{:.2f}", scale=1.0):
        return "-" if value is None else pattern.format(value * scale)

    for m in report["methods"]:
        shares = (m["draft_share"], m["verify_share"], m["overhead_share"])
        grid.add_row(m["name"], fmt(m["tokens_per_second"], "{:.1f}"), fmt(m["speedup"], "{:.2f}x"),
                     fmt(m.get("median_prompt_speedup"), "{:.2f}x"), fmt(m["predicted_speedup"], "{:.2f}x"),
                     fmt(m["acceptance_rate"]), fmt(m.get("conditional_acceptance")),
                     fmt(m["tokens_per_forward"]),
                     "-" if None in shares else "/".join(f"{100 * share:.0f}" for share in shares),
                     fmt(m["peak_rss_mb"], "{:.0f}"), identical_words(m, report["prompts"]))
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(grid)
    title = (f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, medians of {report['runs']} "
             f"rounds ({report['machine']})")
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    parts = [textwrap.fill(title, width), "\n".join(lines).strip("\n")] + [textwrap.fill(LEGEND, width)] * legend
    return "\n".join(parts) + "\n"


def plot(report: dict, path) -> None:
    """Speedup and acceptance against K per draft, with the speedup the formula predicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_alpha) = plt.subplots(1, 2, figsize=(11, 4))
    drafts = sorted({m["draft"] for m in report["methods"] if m["k"] is not None and not m["adaptive"]})
    for draft in drafts:
        rows = sorted((m for m in report["methods"] if m["draft"] == draft and not m["adaptive"] and m["k"]),
                      key=lambda m: m["k"])
        ks = [m["k"] for m in rows]
        line, = ax_speed.plot(ks, [m["speedup"] for m in rows], "o-", label=f"{draft} measured")
        if any(m["predicted_speedup"] for m in rows):
            ax_speed.plot(ks, [m["predicted_speedup"] or float("nan") for m in rows], "--", color=line.get_color(),
                          label=f"{draft} predicted")
        ax_alpha.plot(ks, [m["acceptance_rate"] for m in rows], "o-", color=line.get_color(), label=draft)
        adaptive = [m for m in report["methods"] if m["draft"] == draft and m["adaptive"]]
        for m in adaptive:
            ax_speed.axhline(m["speedup"], color=line.get_color(), linestyle=":", label=f"{draft} adaptive")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="K (drafted tokens per step)", ylabel="speedup over autoregressive", title="Speedup")
    ax_alpha.set(xlabel="K", ylabel="acceptance rate alpha", title="Acceptance", ylim=(0, 1.05))
    ax_speed.legend(fontsize=7)
    ax_alpha.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
