"""The benchmark's report for people: the machine, a table with its legend, a plot."""

from __future__ import annotations

import os
import platform

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from ..models.precision import cpu_features

    # Tables from CPUs with and without native bfloat16 differ most: say which this is.
    native = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
              if flag in cpu_features()]
    cpu += f" ({', '.join(native)})" if native else ""
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


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
