"""speculative: faster language-model generation by speculative decoding, with no change in output."""

from . import _aliases
from .core.config import SpeculativeConfig
from .core.grammar import Grammar
from .core.rows import RequestOutput, SamplingParams
from .core.stats import DecodeStats, RequestStats
from .core.verify import accept_reject, greedy_verify, rejection_verify
from .models import build_model, build_pair, output_size, save_model
from .models import isa as _isa
from .models.base import LanguageModel
from .models.loading import load_model, load_tokenizer
from .proposers import DraftModelProposer, NGramProposer, Proposal, Proposer, SuffixProposer
from .runtime.decoder import SpeculativeDecoder, autoregressive_generate
from .runtime.engine import Engine

__version__ = "0.1.0"

_isa.cap_torch()  # before any PyTorch kernel runs: SPECULATIVE_ISA caps PyTorch's own kernels too

# Old module paths (speculative.engine, speculative.config, ...) for one release: see _aliases.
_aliases.install()


def __getattr__(name: str):
    return _aliases.old_submodule(__name__, name)


__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "autoregressive_generate", "Engine", "SamplingParams",
           "Grammar", "RequestOutput", "RequestStats", "build_model", "build_pair", "output_size", "save_model", "load_model",
           "load_tokenizer", "LanguageModel", "DraftModelProposer", "NGramProposer", "Proposal", "Proposer",
           "SuffixProposer",
           "DecodeStats", "accept_reject", "greedy_verify", "rejection_verify"]
