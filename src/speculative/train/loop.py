"""One training phase: a language model on token data, optionally distilled from a teacher.

A phase runs for a time budget: after some warm-up steps it fixes its step count from
the measured speed, so the learning-rate schedule is a plain function of the step and a
resumed run continues the very same schedule. The budget is checked after every step: a
phase whose steps turn out slower than estimated stops when its seconds are spent, and
any phase stops at the run's deadline. Checkpoints hold the model, the optimizer,
the data generator and the step (written with torch.save, read with weights_only=True).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

# The step count is estimated after ESTIMATE_AT[0] steps and fixed after ESTIMATE_AT[1],
# each time from the mean speed of the steps since the previous estimate.
ESTIMATE_AT = (4, 20)


@dataclass
class PhaseConfig:
    name: str
    # Wall-clock budget of the phase in seconds.
    seconds: float
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.1
    # Distillation temperature (only with a teacher).
    temperature: float = 1.0
    # Fixed number of steps (overrides the time budget), e.g. to match another phase.
    steps: int | None = None
    seed: int = 0
    # Minutes between checkpoints.
    checkpoint_minutes: float = 5.0
    bf16: bool = True
    compile: bool = False
    # time.perf_counter() past which the phase stops after its current step, whatever its
    # steps or seconds (the whole run's budget); None: no deadline.
    deadline: float | None = None


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless (B, T+1) windows at random offsets of the token stream."""
    high = len(data) - seq_len - 1
    if high <= 0:
        raise ValueError(f"training data holds {len(data)} tokens, fewer than one window of {seq_len + 1}")
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        yield torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 2% of the steps, cosine decay to 10% of the peak."""
    warm = max(1, total // 50)
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def phase_loss(model, window, teacher, temperature, autocast):
    inputs, labels = window[:, :-1], window[:, 1:]
    with autocast():
        logits = model(inputs).float()
        if teacher is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        with torch.no_grad():
            target = teacher(inputs).float()
    # Forward KL to the teacher's next-token distribution (DistillSpec, arXiv 2310.08461).
    log_q = F.log_softmax(logits / temperature, -1)
    p = F.softmax(target / temperature, -1)
    return F.kl_div(log_q.reshape(-1, log_q.shape[-1]), p.reshape(-1, p.shape[-1]), reduction="batchmean") \
        * temperature ** 2


@dataclass
class Progress:
    """Where a phase stands: steps done, steps planned (None until estimated), seconds spent."""

    step: int = 0
    total: int | None = None
    spent: float = 0.0


class Checkpoint:
    """A phase's checkpoint file: model, optimizer, data generator and progress."""

    def __init__(self, path: Path, model, optimizer, generator: torch.Generator):
        self.path, self.model, self.optimizer, self.generator = path, model, optimizer, generator

    def save(self, progress: Progress, done: bool = False, summary: dict | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "generator": self.generator.get_state(), "step": progress.step, "total": progress.total,
                 "seconds": progress.spent, "done": done}
        if summary is not None:
            state["summary"] = summary
        torch.save(state, str(self.path) + ".tmp")
        Path(str(self.path) + ".tmp").replace(self.path)

    def resume(self, progress: Progress, name: str) -> dict | None:
        """Load what was saved into the model, optimizer and generator; the summary of a
        finished phase (its model loaded), else None."""
        if not self.path.exists():
            return None
        saved = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(saved["model"])
        if saved.get("done"):
            return saved["summary"]
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        progress.step, progress.total, progress.spent = saved["step"], saved["total"], saved["seconds"]
        print(f"[{name}] resuming at step {progress.step}/{progress.total}")
        return None


def make_optimizer(model, cfg: PhaseConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def train_phase(model, data: torch.Tensor, cfg: PhaseConfig, checkpoint: Path, teacher=None,
                resume: bool = False, loss=None) -> dict:
    """Train `model` in place; returns a summary (steps, tokens, seconds, final loss).
    `loss(window, autocast)`: the phase's own objective on a (B, T+1) window (a draft
    head's); default: next-token cross-entropy, or KL to `teacher` when given."""
    model.train().requires_grad_(True)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    optimizer = make_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    progress, saving = Progress(total=cfg.steps), Checkpoint(checkpoint, model, optimizer, generator)
    if resume:
        finished = saving.resume(progress, cfg.name)
        if finished is not None:
            return finished
    if loss is None:
        forward = torch.compile(model) if cfg.compile else model
        teacher_forward = torch.compile(teacher) if cfg.compile and teacher is not None else teacher
        loss = lambda window, autocast: phase_loss(forward, window, teacher_forward,  # noqa: E731
                                                   cfg.temperature, autocast)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cfg.bf16 else contextlib.nullcontext
    stream = batches(data, cfg.batch_size, cfg.seq_len, generator)
    loss_avg = run_steps(model, optimizer, lambda: loss(next(stream), autocast), cfg, progress, saving)
    model.eval().requires_grad_(False)
    summary = {"steps": progress.step, "tokens": progress.step * cfg.batch_size * cfg.seq_len,
               "seconds": round(progress.spent, 1), "final_loss": None if loss_avg is None else round(loss_avg, 4)}
    saving.save(progress, done=True, summary=summary)
    return summary


def run_steps(model, optimizer, step_loss, cfg: PhaseConfig, progress: Progress, saving: Checkpoint) -> float | None:
    """Optimizer steps until the phase's steps or seconds (or the run's deadline) are spent;
    returns the smoothed loss (None: no step ran)."""
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = tqdm(total=progress.total, initial=progress.step, desc=cfg.name, unit="step", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30)
    last_save = time.perf_counter()
    loss_avg = None
    durations: list[float] = []
    while progress.total is None or progress.step < progress.total:
        if cfg.deadline is not None and time.perf_counter() >= cfg.deadline:
            break  # the run's budget is spent (a phase that starts after it trains no step)
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(progress.step, progress.total or 10 ** 9, cfg.lr)
        value = step_loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        progress.spent += elapsed
        progress.step += 1
        value = value.item()
        loss_avg = value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
        durations.append(elapsed)
        resize_schedule(cfg, progress, durations, bar)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}", refresh=False)
        if time.perf_counter() - last_save > cfg.checkpoint_minutes * 60:
            saving.save(progress)
            last_save = time.perf_counter()
        if cfg.steps is None and progress.spent >= cfg.seconds:
            break  # the phase's budget is spent: steps slower than estimated do not overrun it
    bar.close()
    return loss_avg


def resize_schedule(cfg: PhaseConfig, progress: Progress, durations: list[float], bar) -> None:
    """At the ESTIMATE_AT steps of a timed phase, size the schedule from the mean step time
    since the last estimate (the first step, which may compile, is left out)."""
    step = progress.step
    recent = durations[1:] if step == ESTIMATE_AT[0] else durations[ESTIMATE_AT[0]:]
    if cfg.steps is None and step in ESTIMATE_AT and recent:
        mean = sum(recent) / len(recent)
        progress.total = max(step + 1, int(step + (cfg.seconds - progress.spent) / mean))
        bar.reset(total=progress.total)
        bar.update(step)
