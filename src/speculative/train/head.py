"""`speculative train-head`: a draft head for a target, trained on the target's own features.

The target runs on the fly, without gradients (in bfloat16 autocast where the CPU runs it
fast), over windows of the data: it gives the features the head reads and the next-token
distributions p it learns. The loss is the cross-entropy from p, restricted to the head's
vocabulary and renormalized there, to the head's q, unrolled over `unroll` steps in which
the head reads its own output features in place of the target's (the training-time test
of EAGLE-3 / HASS, in its simple form: step j reads token x_{t+j} with the head's step-(j-1) output at t):

    step 0: (x_t, f_{t-1}) -> h0_t ~ f_t, q0_t vs p_t
    step j: (x_{t+j}, h(j-1)_t) -> hj_t ~ f_{t+j}, qj_t vs p_{t+j}

Data sources (`head_command.py`): `stdlib` (the standard library, held-out files apart),
`sharegpt` (`sharegpt.py`), or a JSONL file of texts or conversations.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.config import SpeculativeConfig
from ..runtime.decoder import SpeculativeDecoder, autoregressive_generate
from ..models.kernels import PackedLinear
from ..models.head import DraftHead, build_head, load_head, save_head
from ..models.precision import cpu_has_fast
from .loop import PhaseConfig, train_phase

# Weight of unrolled step j in the loss: later steps matter less (they are reached less often).
STEP_DECAY = 0.8


@dataclass
class HeadTraining:
    # Wall-clock budget of the training in seconds.
    seconds: float
    # Unrolled drafting steps per window (1 = no training-time test).
    unroll: int = 3
    # Reduced vocabulary: the head scores the N most frequent training tokens (0 = all).
    vocab: int = 0
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    seed: int = 0
    # Fixed step count (overrides the time budget): reproducible tests.
    steps: int | None = None
    # bfloat16 autocast: only where the CPU multiplies it natively (emulated, a step took
    # 15x float32's time on an AVX2 CPU).
    bf16: bool = field(default_factory=lambda: cpu_has_fast(torch.bfloat16))
    # Attention heads of the head's block.
    num_heads: int = 4
    # A trained head to start from (a warm start: its weights and vocabulary, a new
    # schedule); None: a fresh head.
    init: str | Path | None = None

    def __post_init__(self) -> None:
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.vocab < 0:
            raise ValueError(f"vocab must be >= 0 (0 = all tokens), got {self.vocab}")


def frequent_ids(data: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor | None:
    """The n most frequent ids of the data, most frequent first (None for n = 0 or n >= vocab)."""
    if n == 0 or n >= vocab_size:
        return None
    counts = torch.bincount(data.long(), minlength=vocab_size)
    return counts.topk(n).indices


def target_view(target, out_head, window: torch.Tensor):
    """The target's features (B, T, H) and next-token probabilities over the head's
    vocabulary (B, T, V'), renormalized there: the target's logits are computed for the
    head's tokens only (Gemma's 262k-token output layer would cost more than the rest)."""
    state = target.new_state(window.shape[0], window.shape[1])
    with torch.autocast(window.device.type, enabled=False):  # its cache keeps the target's dtype
        _, hidden = target.forward(window, state, keep_logits=False, return_hidden=True)
        return hidden.float(), out_head(hidden).float().softmax(-1)


def head_loss(head: DraftHead, target, out_head, window: torch.Tensor, unroll: int) -> torch.Tensor:
    """The unrolled loss of the module docstring on tokens (B, T)."""
    with torch.no_grad():
        features, p = target_view(target, out_head, window)
        embedded = target.embed(window).float()
    previous = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)  # f_{t-1}
    total, weights = 0.0, 0.0
    width = window.shape[1]
    for j in range(min(unroll, width)):
        n = width - j
        hidden = head(embedded[:, j:j + n], previous[:, :n])  # (B, n, H)
        log_q = out_head(hidden).log_softmax(-1)
        loss = -(p[:, j:j + n] * log_q).sum(-1).mean()
        total = total + STEP_DECAY ** j * loss
        weights += STEP_DECAY ** j
        previous = hidden
    return total / weights


def evaluate(target, head, prompts: list[list[int]], max_new_tokens: int = 64, k: int = 4) -> dict:
    """Greedy drafting with the head at fixed K on held-out prompts: alpha, alpha per
    position (accepted at i / drafted at i), tau, and whether every output matched."""
    decoder = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=k, adaptive=False,
                                                                 prompt_lookup=False))
    identical = True
    for ids in prompts:
        identical &= decoder.generate(ids, max_new_tokens) == autoregressive_generate(target, ids, max_new_tokens)
    stats = decoder.stats
    per_position = [round(a / d, 4) if d else 0.0 for a, d in zip(stats.accepted_at, stats.drafted_at)]
    return {"acceptance_rate": round(stats.acceptance_rate, 4), "acceptance_at": per_position,
            "tokens_per_forward": round(stats.tokens_per_forward, 3), "k": k, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "identical_to_target": identical}


def train_head(target, data: torch.Tensor, out: Path, cfg: HeadTraining, target_name: str = "unknown",
               resume: bool = False) -> tuple[DraftHead, dict]:
    """Train a head for `target` on the token stream `data`; saves it in `out` (with a
    checkpoint for --resume) and returns it with the training summary."""
    out = Path(out)
    if any(isinstance(m, PackedLinear) for m in target.modules()):
        raise ValueError("the target's linear layers are packed for inference and pass no gradients to the head: "
                         "load it with load_model(..., pack=False) to train a head")
    target.eval().requires_grad_(False)
    if cfg.init is None:
        vocab_ids = frequent_ids(data, target.vocab_size, cfg.vocab)
        head = build_head(target, target_name, vocab_ids, seed=cfg.seed, num_heads=cfg.num_heads).float()
    else:
        head = warm_start(target, target_name, cfg)
    out_head = target.output_head(head.vocab_ids)
    phase = PhaseConfig("head", cfg.seconds, batch_size=cfg.batch_size, seq_len=cfg.seq_len - 1, lr=cfg.lr,
                        weight_decay=0.0, steps=cfg.steps, seed=cfg.seed, bf16=cfg.bf16)
    started = time.perf_counter()
    summary = train_phase(head, data, phase, out / "checkpoint.pt", resume=resume,
                          loss=lambda window, autocast: _autocast_loss(head, target, out_head, window, cfg, autocast))
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    summary["data_tokens"] = int(len(data))
    save_head(head, out / "head")
    return head, summary


def warm_start(target, target_name: str, cfg: HeadTraining) -> DraftHead:
    """The head at cfg.init, refused unless trained for this target and of the shape asked
    for; it keeps its own vocabulary (its output rows are what it learned)."""
    from ..models.loading import resolve

    head = load_head(resolve(str(cfg.init)), target.device)
    head.check_target(target)
    width = 0 if head.vocab_ids is None else len(head.vocab_ids)
    if cfg.vocab and cfg.vocab != width:
        raise ValueError(f"--vocab {cfg.vocab} differs from the vocabulary of the head at {cfg.init} "
                         f"({width or 'all'} tokens); leave --vocab out to keep it")
    if head.cfg.num_heads != cfg.num_heads:
        raise ValueError(f"the head at {cfg.init} has {head.cfg.num_heads} attention heads, not {cfg.num_heads}")
    head.record_target(target, target_name)
    return head.float()


def _autocast_loss(head, target, out_head, window, cfg, autocast):
    with autocast():
        return head_loss(head, target, out_head, window, cfg.unroll)


def run_train_head(target, target_name: str, train_data: torch.Tensor, held_prompts: list[list[int]], out: Path,
                   cfg: HeadTraining, resume: bool = False, source: str = "") -> dict:
    """Train, then evaluate the trained head and an untrained one on the held-out prompts;
    writes report.json beside the head."""
    out = Path(out)
    head, summary = train_head(target, train_data, out, cfg, target_name, resume)
    untrained = build_head(target, target_name, head.vocab_ids, seed=cfg.seed, num_heads=cfg.num_heads)
    report = {"target": target_name, "data": source, "training": summary,
              "init": None if cfg.init is None else str(cfg.init),
              "vocab": 0 if head.vocab_ids is None else len(head.vocab_ids), "unroll": cfg.unroll,
              "head_parameters": sum(p.numel() for n, p in head.named_parameters() if "embed_tokens" not in n),
              "trained": evaluate(target, load_head(out / "head"), held_prompts),
              "untrained": evaluate(target, untrained, held_prompts)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
