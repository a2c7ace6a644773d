"""speculative: faster language-model generation by speculative decoding, with no change in output."""

from .config import SpeculativeConfig
from .decoder import SpeculativeDecoder, autoregressive_generate
from .engine import Engine
from .models import build_model, build_pair, output_size, save_model
from .models.base import LanguageModel
from .proposers import DraftModelProposer, NGramProposer, Proposal, Proposer, SuffixProposer
from .rows import RequestOutput, SamplingParams
from .stats import DecodeStats, RequestStats
from .verify import accept_reject, greedy_verify, rejection_verify

__version__ = "0.1.0"
from .loading import load_model, load_tokenizer


__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "autoregressive_generate", "Engine", "SamplingParams",
           "RequestOutput", "RequestStats", "build_model", "build_pair", "output_size", "save_model", "load_model",
           "load_tokenizer", "LanguageModel", "DraftModelProposer", "NGramProposer", "Proposal", "Proposer",
           "SuffixProposer",
           "DecodeStats", "accept_reject", "greedy_verify", "rejection_verify"]
