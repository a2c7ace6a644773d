"""EngineArgs: every front-end reads, checks and builds its engine options the same way.

The same options give the same EngineArgs (and so the same engine) on `generate`, `serve`,
`batch` and `bench`; the same mistake gets the same error line on each; EngineArgs pickles
(Ray actors rebuild from it) and refuses in Python what the command line refuses.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from speculative.entrypoints.batch import ModelSpec
from speculative.entrypoints.cli import main
from speculative.core.config import LOOKUP_K, MODEL_K
from speculative.entrypoints.engine_args import EngineArgs
from speculative.proposers import NGramProposer
from speculative.models.loading import ASSETS

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")
OPTIONS = ["--target", "default", "--draft", "default-draft+ngram", "-k", "6", "--fixed-k", "--draft-temperature",
           "0.7", "--ngram-min", "2", "--ngram-max", "5", "--tree-top-k", "2", "--tree-max-tokens", "12", "--dtype",
           "float32", "--draft-dtype", "float32", "--draft-vocab", "128", "--device", "cpu"]
# What bench takes of them (its drafts, K and trees are lists of methods, not one engine).
BENCH_OPTIONS = ["--target", "default", "--dtype", "float32", "--draft-dtype", "float32", "--draft-vocab", "128",
                 "--device", "cpu", "--tree-max-tokens", "12"]
MODEL_FIELDS = ("target", "device", "dtype", "draft_dtype", "draft_vocab", "draft_vocab_corpus", "tree_max_tokens")


class Stop(Exception):
    """Raised where a front-end would load its models: the options it would load them with are recorded."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": 1, "prompt": "def f():"}) + "\n")
    return path


def front_ends(tmp_path, records) -> dict:
    return {"generate": ["generate"], "serve": ["serve", "--port", str(free_port())],
            "batch": ["batch", str(records), str(tmp_path / "out.jsonl"), "--no-progress"]}


@pytest.fixture
def recorded(monkeypatch):
    """The EngineArgs each front-end builds from (or, for bench, loads its target with)."""
    seen = []

    def record(args, *_, **__):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(EngineArgs, "build", record)
    monkeypatch.setattr(EngineArgs, "load_target", record)
    return seen


def test_the_same_options_give_the_same_engine_on_every_front_end(tmp_path, records, recorded, capsys):
    for argv in front_ends(tmp_path, records).values():
        assert main([*argv, *OPTIONS]) == 1  # Stop, one line on stderr
    assert main(["bench", *BENCH_OPTIONS]) == 1
    assert capsys.readouterr().err.count("error: Stop") == 4
    generate, serve, batch, bench = recorded
    assert generate == serve == EngineArgs(**{k: v for k, v in vars(batch).items() if k != "max_new_tokens"})
    assert generate.checked and (generate.draft, generate.num_draft_tokens, generate.adaptive) == (
        "default-draft+ngram", 6, False)
    assert (generate.ngram_min, generate.ngram_max, generate.tree_top_k, generate.draft_vocab) == (2, 5, 2, 128)
    assert generate.config(sampling=False) == serve.config(sampling=False) == batch.config(sampling=False)
    assert {f: getattr(bench, f) for f in MODEL_FIELDS} == {f: getattr(generate, f) for f in MODEL_FIELDS}


def test_defaults_resolve_alike_on_every_front_end(tmp_path, records, recorded):
    for argv in front_ends(tmp_path, records).values():
        assert main(argv) == 1  # Stop
    assert {(a.draft, a.num_draft_tokens, a.lookup_draft_tokens, a.ngram_min, a.ngram_max, a.adaptive)
            for a in recorded} == {("default-draft+ngram", MODEL_K, None, 1, 4, True)}
    assert EngineArgs(target="elsewhere").validate().num_draft_tokens == LOOKUP_K  # the partner of others: ngram
    reach = EngineArgs(lookup_draft_tokens=24).config(sampling=False)  # lookup matches up to 24, the model up to K
    assert (reach.num_draft_tokens, reach.lookup_draft_tokens, reach.longest_draft) == (MODEL_K, 24, 24)


MISTAKES = [["--draft", "ngram", "--draft-vocab", "8"], ["--draft", "none", "-k", "3"],
            ["--draft", "default-draft", "--ngram-min", "2"], ["--ngram-min", "5", "--ngram-max", "2"],
            ["--tree-max-tokens", "8"], ["--draft-vocab-corpus", "x.txt"], ["--device", "meta"],
            ["--draft", "default-draft", "--draft-vocab", "-1"], ["-k", "0"], ["--tree-top-k", "40"],
            ["--dtype", "float64"], ["--draft", "ngram", "--lookup-draft-tokens", "8"]]


@pytest.mark.parametrize("mistake", MISTAKES, ids=" ".join)
def test_the_same_mistake_gets_the_same_error_on_every_front_end(tmp_path, records, capsys, mistake):
    lines = {}
    for name, argv in front_ends(tmp_path, records).items():
        capsys.readouterr()
        assert main([*argv, *mistake]) == 2
        lines[name] = capsys.readouterr().err.replace(f"`speculative {name} --help`", "`speculative COMMAND --help`")
    assert len(set(lines.values())) == 1, lines
    assert lines["generate"].startswith("error: ") and lines["generate"].count("\n") == 1


@pytest.mark.parametrize("mistake, words", [
    (["--draft", "ngram", "--draft-vocab", "8"], "error: --draft-vocab does nothing with --draft ngram"),
    (["--ngram-min", "5", "--ngram-max", "2"], "error: --ngram-min 5 is above --ngram-max 2")])
def test_the_real_command_refuses_alike_everywhere(tmp_path, records, mistake, words):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in front_ends(tmp_path, records).values():
        run = subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", *argv, *mistake],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 2 and run.stdout == "" and run.stderr.startswith(words), run.stderr
        assert run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("changes, message", [
    (dict(num_draft_tokens=0), "--num-draft-tokens (-k) must be an integer in 1..64, got 0"),
    (dict(lookup_draft_tokens=65), "--lookup-draft-tokens must be an integer in 1..64, got 65"),
    (dict(draft="default-draft", lookup_draft_tokens=8), "--lookup-draft-tokens applies to a draft model with"),
    (dict(tree_top_k=True), "--tree-top-k must be an integer in 1..32, got True"),
    (dict(max_batch_size=0), "--max-batch-size must be an integer in 1..65536, got 0"),
    (dict(seed=-1), "--seed must be an integer in 0..18446744073709551615, got -1"),
    (dict(draft_temperature=float("nan")), "--draft-temperature must be a finite number >= 0, got nan"),
    (dict(top_p=0.0), "--top-p must be a finite number > 0 and <= 1, got 0.0"),
    (dict(draft_vocab=-1), "--draft-vocab must be >= 0 (0 = all tokens), got -1"),
    (dict(draft="none", adaptive=False), "--fixed-k does nothing with --draft none"),
    (dict(device="tpu"), "--device 'tpu' is not a torch device")])
def test_python_callers_get_the_command_lines_refusals(changes, message):
    with pytest.raises(ValueError) as caught:
        EngineArgs(**changes).validate()
    assert message in str(caught.value)


def test_engine_args_pickle_and_validate_once():
    spec = ModelSpec(draft="ngram", max_batch_size=3, max_new_tokens=7).validate()
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.validate() is again and isinstance(again, ModelSpec)
    assert (again.num_draft_tokens, again.max_new_tokens, again.checked) == (LOOKUP_K, 7, True)
    assert replace(again, threads=2).threads == 2


def test_build_gives_the_engine_and_the_decoder_the_options_ask_for():
    built = EngineArgs(draft="ngram", num_draft_tokens=3, max_batch_size=2, temperature=0.5, seed=4).build()
    engine, decoder = built.engine(), built.decoder()
    assert engine.max_batch_size == 2 and engine.config.num_draft_tokens == 3 and engine.config.target_temperature == 1.0
    assert decoder.config.target_temperature == 0.5 and decoder.config.seed == 4 and not decoder.config.greedy_verification
    assert built.context == built.target.max_seq_len and built.tokenizer.encode("def")
    plain = EngineArgs(draft="none").build()
    assert plain.draft is None and plain.context == built.context
    ids = plain.tokenizer.encode("def add(a, b):")
    assert built.decoder().generate(ids, 0) == [] and plain.decoder().generate(ids, 4) == EngineArgs(
        draft="ngram").build().decoder().generate(ids, 4)  # greedy: the same tokens whatever drafts


def test_draft_vocab_auto_reduces_only_a_draft_model_over_a_large_vocabulary(monkeypatch):
    """auto (the default): AUTO_DRAFT_VOCAB tokens for a draft model over more than LARGE_VOCAB
    (Qwen2.5-Coder 0.5B's 151,936), all tokens for smaller ones and for lookup; a number given
    is taken as it is, 0 meaning all tokens."""
    from speculative.proposers import NGramProposer
    from speculative.proposers import vocab
    from tests.helpers import tiny

    counted = []
    monkeypatch.setattr(vocab, "corpus_vocab", lambda tokenizer, n, corpus="stdlib": counted.append((n, corpus)) or n)
    large, small = tiny("decoder_only", vocab=vocab.LARGE_VOCAB + 1), tiny("decoder_only", vocab=vocab.LARGE_VOCAB)
    assert [vocab.auto_size(large), vocab.auto_size(small)] == [vocab.AUTO_DRAFT_VOCAB, 0]
    assert vocab.auto_size(NGramProposer()) == vocab.auto_size(None) == 0
    auto = EngineArgs(draft="default-draft").validate()
    assert auto.draft_vocab is None
    tokenizer = object()  # (read by corpus_vocab only, stood in for above)
    assert [auto.vocabulary(tokenizer, large), auto.vocabulary(tokenizer, small)] == [vocab.AUTO_DRAFT_VOCAB, None]
    assert auto.vocabulary(None, large) is None  # no tokenizer to count with: all tokens
    assert EngineArgs(draft_vocab=0).vocabulary(tokenizer, large) is None
    assert EngineArgs(draft_vocab=100).vocabulary(tokenizer, small) == 100
    assert counted == [(vocab.AUTO_DRAFT_VOCAB, "stdlib"), (100, "stdlib")]


DRAFTING = ("num_draft_tokens", "lookup_draft_tokens", "adaptive", "prompt_lookup", "min_ngram", "max_ngram",
            "draft_temperature", "tree_top_k", "tree_max_tokens")


def drafting(decoder) -> tuple:
    """What a decoder drafts with: its config's drafting settings, its proposer's kinds and K,
    and the vocabulary its draft model scores."""
    proposer = decoder.proposer
    parts = [type(proposer).__name__]
    for inner in (getattr(proposer, "drafter", None), getattr(proposer, "ngram", None)):
        if inner is not None:
            parts.append(type(inner).__name__)
    lookup = getattr(proposer, "ngram", proposer if isinstance(proposer, NGramProposer) else None)
    model_proposer = getattr(proposer, "drafter", proposer)
    vocab = getattr(model_proposer, "vocab", None)
    return (tuple(getattr(decoder.config, name) for name in DRAFTING), tuple(parts),
            getattr(lookup, "num_draft_tokens", None), None if vocab is None else vocab.tolist())


def test_the_python_api_drafts_with_the_command_lines_defaults(tmp_path, monkeypatch):
    """SpeculativeDecoder(target, draft) and Engine(target, draft), with nothing set, draft as
    `generate` does with the same models (EngineArgs: the partner draft behind prompt lookup,
    K, lookup K, n-gram sizes, the adaptive policy, the reduced vocabulary of a draft over a
    large one); one set of defaults (core.config, proposers.default_config, vocab.auto_vocab)."""
    from speculative import Engine, SpeculativeDecoder, load_model, save_model
    from speculative.models.loading import load_draft
    from speculative.proposers import vocab
    from tests.helpers import tiny

    built = EngineArgs(target="default").build()  # its partner: default-draft+ngram
    library = SpeculativeDecoder(load_model("default"), load_draft("default-draft"))
    assert drafting(library) == drafting(built.decoder())
    assert drafting(library)[1] == ("HybridProposer", "DraftModelProposer", "NGramProposer")
    lookup = EngineArgs(target="default", draft="ngram").build()
    assert drafting(SpeculativeDecoder(lookup.target, NGramProposer())) == drafting(lookup.decoder())
    assert drafting(lookup.decoder())[2] == LOOKUP_K
    engine = Engine(built.target, NGramProposer())
    assert (engine.config.num_draft_tokens, engine.config.adaptive) == (LOOKUP_K, True)
    # A draft over a large vocabulary: the same reduced vocabulary by both roads.
    monkeypatch.setattr(vocab, "corpus_vocab", lambda tokenizer, n, corpus="stdlib": torch.arange(0, 2 * n, 2))
    monkeypatch.setattr(vocab, "AUTO_DRAFT_VOCAB", 1000)
    save_model(tiny("decoder_only", vocab=vocab.LARGE_VOCAB + 1, seed=1), tmp_path / "target")
    save_model(tiny("decoder_only", vocab=vocab.LARGE_VOCAB + 1, seed=2), tmp_path / "draft")
    target = load_model(tmp_path / "target", dtype="float32")
    target.tokenizer = built.tokenizer
    args = EngineArgs(target=str(tmp_path / "target"), draft=f"{tmp_path / 'draft'}+ngram", dtype="float32",
                      draft_dtype="float32")
    cli = args.validate()
    cli_decoder = SpeculativeDecoder(target, load_draft(tmp_path / "draft", dtype="float32"), cli.config(),
                                     draft_vocab=cli.vocabulary(target.tokenizer, target))
    library = SpeculativeDecoder(target, load_draft(tmp_path / "draft", dtype="float32"))
    assert drafting(library)[0] == drafting(cli_decoder)[0]
    assert drafting(library)[3] == drafting(cli_decoder)[3] == list(range(0, 2000, 2))
    ids = [5, 6, 7, 8] * 3
    assert library.generate(ids, 12) == cli_decoder.generate(ids, 12)
