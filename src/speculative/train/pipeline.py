"""`speculative train`: tokenizer, verifier and drafts from scratch, then a quality report.

Phases, each resumable from its checkpoint:
1. a byte-level BPE on the training files;
2. the verifier (decoder_only) on the data;
3. the decoder_only draft, distilled from the verifier (KL to its next-token distribution);
4. the same draft trained on the data alone, for the same number of steps (the comparison
   DistillSpec makes; it is reported, not shipped);
5. the s4d draft, distilled;
6. held-out perplexity per model, and greedy acceptance per draft at K = 4.

--max-minutes is a deadline for the whole run, checked inside every long step: reading
and encoding the data take at most DATA_SHARE of it (the files read by then), each
training phase stops when its share is spent (the data-only draft, a comparison, trains
the distilled draft's number of steps), and the report measures what it can before
the deadline (at least one window and one prompt per model). What is left past the
deadline is only the last step of each part and the saving of the files.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import build_model, load_builtin, save_model
from . import corpus
from .loop import PhaseConfig, train_phase
from .report import acceptance, perplexity

# Share of the time left after the data per training phase (the rest: the report).
BUDGET = {"verifier": 0.65, "draft": 0.11, "draft_s4d": 0.12}
# Most of the budget that reading the data and training the tokenizer may take.
DATA_SHARE = 0.25
# Seconds kept for the report, when the budget is long enough to keep them.
REPORT_SECONDS = 60


@dataclass
class TrainOptions:
    out: Path
    max_minutes: float = 90.0
    resume: bool = False
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 16
    verifier: dict = field(default_factory=lambda: {"hidden_size": 384, "num_layers": 8, "num_heads": 6})
    draft: dict = field(default_factory=lambda: {"hidden_size": 128, "num_layers": 2, "num_heads": 2})
    draft_s4d: dict = field(default_factory=lambda: {"hidden_size": 128, "num_layers": 2, "state_dim": 32})
    max_files: int | None = None
    eval_prompts: int = 20
    eval_new_tokens: int = 64
    compile: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_minutes, bool) or not isinstance(self.max_minutes, (int, float)) \
                or not 0 < self.max_minutes < float("inf"):
            raise ValueError(f"max_minutes must be a finite number > 0, got {self.max_minutes!r}")
        for name in ("vocab_size", "seq_len", "batch_size", "eval_prompts", "eval_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class Data:
    """The corpus as the phases and the report read it."""

    tokenizer: object
    train_files: list
    held_files: list
    train_ids: torch.Tensor
    held_ids: torch.Tensor

    @property
    def vocab(self) -> int:
        return self.tokenizer.get_vocab_size()


def run_training(opts: TrainOptions) -> dict:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    budget = opts.max_minutes * 60
    deadline = started + budget
    data = read_data(opts, out, started + DATA_SHARE * budget)
    models, summaries = train_models(opts, out, data, deadline, budget)
    untrained = [name for name, summary in summaries.items() if not summary["steps"]]
    if untrained:
        print(f"the {opts.max_minutes:g}-minute budget was spent before {', '.join(untrained)} trained a step: "
              "they are left as initialised; give more --max-minutes", file=sys.stderr)
    report = quality_report(opts, data, models, summaries, deadline)
    report["minutes"] = round((time.perf_counter() - started) / 60, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} in {report['minutes']} minutes")
    return report


def read_data(opts: TrainOptions, out: Path, data_deadline: float) -> Data:
    """The tokenizer (trained, or read back when resuming) and the encoded training and held-out files."""
    train_files, held_files = corpus.split_files(opts.max_files)
    print(f"corpus: {len(train_files)} training files, {len(held_files)} held out ({corpus.stdlib_root()})")
    tokenizer_path = out / "tokenizer.json"
    if opts.resume and tokenizer_path.exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        tokenizer = corpus.train_tokenizer(train_files, opts.vocab_size, data_deadline)
        tokenizer.save(str(tokenizer_path))
    train_ids = corpus.encode_files(tokenizer, train_files, data_deadline, min_tokens=opts.seq_len + 2)
    held_ids = corpus.encode_files(tokenizer, held_files, data_deadline, min_tokens=opts.seq_len + 2)
    data = Data(tokenizer, train_files, held_files, train_ids, held_ids)
    print(f"tokenizer: {data.vocab} tokens; data: {len(train_ids):,} training tokens, {len(held_ids):,} held out")
    return data


def train_models(opts: TrainOptions, out: Path, data: Data, deadline: float, budget: float) -> tuple[dict, dict]:
    """Phases 2-5: the target ("verifier" in files and reports), then the drafts; the
    models (as shipped: float16, loaded back) and their training summaries by name."""

    def phase(name, model_type, model_opts, seconds, teacher=None, steps=None, seed=0, until=deadline):
        model = build_model(model_type, data.vocab, {**model_opts, "max_seq_len": opts.seq_len}
                            if model_type == "decoder_only" else model_opts, seed=opts.seed + seed)
        cfg = PhaseConfig(name=name, seconds=seconds, steps=steps, batch_size=opts.batch_size, seq_len=opts.seq_len,
                          lr=1e-3 if model_type == "decoder_only" else 2e-3, seed=opts.seed + seed,
                          compile=opts.compile and model_type == "decoder_only", deadline=until)
        summary = train_phase(model, data.train_ids, cfg, out / "checkpoints" / f"{name}.pt", teacher, opts.resume)
        save_model(model, out / name, weight_dtype=torch.float16)
        # Continue with the shipped precision, so every figure describes the shipped files.
        return load_builtin(out / name), summary

    models, summaries = {}, {}
    left = max(0.0, deadline - time.perf_counter())
    models["verifier"], summaries["verifier"] = phase("verifier", "decoder_only", opts.verifier,
                                                      left * BUDGET["verifier"])
    target = models["verifier"]
    models["draft"], summaries["draft"] = phase("draft", "decoder_only", opts.draft, left * BUDGET["draft"],
                                                teacher=target, seed=1)
    # The comparison needs the draft's very steps: no deadline (it takes at most about the draft's time).
    models["draft_data_only"], summaries["draft_data_only"] = phase(
        "draft_data_only", "decoder_only", opts.draft, 0, steps=summaries["draft"]["steps"], seed=1, until=None)
    remaining = deadline - time.perf_counter() - (REPORT_SECONDS if budget > 4 * REPORT_SECONDS else 0)
    models["draft_s4d"], summaries["draft_s4d"] = phase("draft_s4d", "s4d", opts.draft_s4d,
                                                        max(0.0, min(left * BUDGET["draft_s4d"], remaining)),
                                                        teacher=target, seed=2)
    return models, summaries


def quality_report(opts: TrainOptions, data: Data, models: dict, summaries: dict, deadline: float) -> dict:
    """Phase 6: held-out perplexity of every model, greedy acceptance of every draft at K = 4."""
    print("report: held-out perplexity and greedy acceptance at K = 4")
    new_tokens = min(opts.eval_new_tokens, opts.seq_len // 2)
    room = opts.seq_len - new_tokens  # keep the end of each prompt that fits the models
    prompts = [data.tokenizer.encode(p).ids[-room:]
               for p in corpus.function_prompts(data.held_files, opts.eval_prompts)]
    report = {"corpus": {"train_files": len(data.train_files), "held_out_files": len(data.held_files),
                         "train_tokens": len(data.train_ids), "held_out_tokens": len(data.held_ids),
                         "vocab_size": data.vocab},
              "models": {}}
    target = models["verifier"]
    for name, model in models.items():
        entry = {"parameters": sum(p.numel() for p in model.parameters()), "training": summaries[name],
                 "held_out_perplexity": round(perplexity(model, data.held_ids, opts.seq_len, deadline=deadline), 3)}
        if name != "verifier":
            entry["greedy"] = acceptance(target, model, prompts, new_tokens, deadline=deadline)
        report["models"][name] = entry
        print(f"  {name:16s} {entry['parameters'] / 1e6:6.2f}M params  perplexity {entry['held_out_perplexity']:8.2f}"
              + (f"  alpha {entry['greedy']['acceptance_rate']:.3f}  tau {entry['greedy']['tokens_per_forward']:.2f}"
                 if "greedy" in entry else ""))
    return report
