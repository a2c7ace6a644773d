"""Token trees: the tree shape, its mask and positions, greedy exactness, and lossless sampling."""

import warnings

import pytest
import torch

from speculative import Engine, NGramProposer, SamplingParams, SpeculativeConfig, SpeculativeDecoder, \
    autoregressive_generate
from speculative.models.base import prefill
from speculative.core.tree import Tree, from_branches, tree_inputs
from tests.helpers import perturbed, sharpen, tiny

torch.set_num_threads(1)


def repetitive_prompts(count, vocab=64, seed=0):
    """Prompts that repeat short phrases with variations, so lookups find several continuations."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        phrases = [torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(4)]
        order = torch.randint(0, 4, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append([t for i in order for t in phrases[i]])
    return prompts


def test_tree_checks_and_shape():
    with pytest.raises(ValueError, match="parent 2; allowed -1..0"):
        Tree([1, 2], [-1, 2])
    tree = Tree([5, 6, 7, 8], [-1, -1, 0, 2])
    assert tree.depths() == [1, 1, 2, 3]
    assert tree.path(3) == [0, 2, 3] and tree.path(-1) == []
    assert tree.children() == [[0, 1], [2], [], [3], []]
    assert Tree.chain([4, 4, 4]).parents == [-1, 0, 1]


def test_branches_merge_shared_prefixes_ranked_by_count():
    branches = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [9, 9, 9]]
    tree = from_branches(branches, top_k=2, max_nodes=16, max_depth=3)
    assert (tree.tokens, tree.parents) == ([1, 2, 3, 4, 9, 9, 9], [-1, 0, 1, 1, -1, 4, 5])
    assert from_branches(branches, top_k=1, max_nodes=16, max_depth=3).tokens == [1, 2, 3]
    small = from_branches(branches, top_k=2, max_nodes=4, max_depth=2)
    assert (small.tokens, small.parents) == ([1, 2, 9, 9], [-1, 0, -1, 2])


def test_config_checks():
    assert SpeculativeConfig().tree_top_k == 1 and not SpeculativeConfig().trees
    for name in ("tree_top_k", "tree_max_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            SpeculativeConfig(**{name: 0})
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig(**{name: 2.5})


def hf(kind):
    """Tiny transformers models through the adapter; gemma has a sliding window of 4 positions."""
    transformers = pytest.importorskip("transformers")
    from speculative.models.hf import HFModel

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return HFModel(transformers.LlamaForCausalLM(config))
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"],
                                           max_position_embeddings=256)
    return HFModel(transformers.Gemma3ForCausalLM(config))


MODELS = {"decoder_only": lambda: tiny("decoder_only", seed=3), "llama": lambda: hf("llama"),
          "gemma3 sliding": lambda: hf("gemma")}


@pytest.mark.parametrize("kind", list(MODELS))
def test_mask_and_positions_match_each_path_fed_alone(kind):
    """Every node's logits in one tree forward equal the logits of its path fed on its own."""
    model = MODELS[kind]()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]
    trees = [Tree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 2, 1]), Tree([20, 21, 22], [-1, 0, -1])]
    with torch.inference_mode():
        state = prefill(model, prompts, 32)
        starts = [len(p) - 1 for p in prompts]
        tokens, positions, mask, counts = tree_inputs(trees, [p[-1] for p in prompts], starts, model.device)
        logits = model.forward(tokens, state, counts, positions=positions, tree=mask)
        for b, (prompt, tree) in enumerate(zip(prompts, trees)):
            for node in range(-1, len(tree)):
                path = prompt + [tree.tokens[i] for i in tree.path(node)]
                alone = model.forward(torch.tensor([path]), model.new_state(1, 32))[0, -1]
                torch.testing.assert_close(logits[b, node + 1], alone, atol=1e-4, rtol=1e-4)
        # Compaction keeps one path, after which a plain forward continues it exactly.
        model.compact(state, starts, [[0, 1, 3, 5], [0, 3]])
        assert state.lengths == [starts[0] + 4, starts[1] + 2]
        nxt = model.forward(torch.tensor([[7], [7]]), state)[:, 0]
        for b, path in enumerate([[10, 12, 14], [22]]):
            alone = model.forward(torch.tensor([prompts[b] + path + [7]]), model.new_state(1, 32))[0, -1]
            torch.testing.assert_close(nxt[b], alone, atol=1e-4, rtol=1e-4)


TREE = SpeculativeConfig(num_draft_tokens=6, tree_top_k=3, tree_max_tokens=12, adaptive=False)


def off_first_branch(tree, path):
    """Whether an accepted path goes through a child that is not its parent's first."""
    children = tree.children()
    return any(children[tree.parents[node] + 1][0] != node for node in path)


@pytest.fixture
def kept_paths(monkeypatch):
    """Every (tree, accepted path) the engine verifies."""
    import speculative.runtime.phases as phases_module

    seen, verify = [], phases_module.tree_verify_rows

    def recording(trees, *args):
        paths, extra = verify(trees, *args)
        seen.extend(zip(trees, paths))
        return paths, extra

    monkeypatch.setattr(phases_module, "tree_verify_rows", recording)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_trees_are_greedy_exact_in_ragged_batches(seed, kept_paths):
    target = tiny("decoder_only", seed=seed)
    prompts = repetitive_prompts(5, seed=seed)
    budgets = [40, 7, 25, 1, 33]
    decoder = SpeculativeDecoder(target, NGramProposer(num_draft_tokens=6), TREE)
    out = decoder.generate(prompts, budgets)
    assert out == autoregressive_generate(target, prompts, budgets)
    assert decoder.stats.accepted > 0  # trees were drafted and kept
    assert any(off_first_branch(tree, path) for tree, path in kept_paths)  # ... and they branched


@pytest.mark.parametrize("kind", ["llama", "gemma3 sliding"])
def test_transformers_targets_verify_trees_exactly(kind, kept_paths):
    target = MODELS[kind]()
    prompts = repetitive_prompts(3, seed=4)
    budgets = [30, 9, 22]
    decoder = SpeculativeDecoder(target, NGramProposer(num_draft_tokens=6), TREE)
    assert decoder.generate(prompts, budgets) == autoregressive_generate(target, prompts, budgets)
    assert any(off_first_branch(tree, path) for tree, path in kept_paths)


def test_eos_and_budget_inside_a_branch():
    """Stop tokens and budgets cut inside an accepted path; rows that stop leave, others go on."""
    target = tiny("decoder_only", seed=4)
    prompts = repetitive_prompts(4, seed=7)
    reference = autoregressive_generate(target, prompts, 30)
    eos = reference[0][5]  # a token the first row emits, likely inside a drafted path
    expected = autoregressive_generate(target, prompts, [30, 3, 30, 11], eos_token_id=eos)
    decoder = SpeculativeDecoder(target, NGramProposer(num_draft_tokens=6), TREE)
    assert decoder.generate(prompts, [30, 3, 30, 11], eos_token_id=eos) == expected


def test_engine_with_requests_joining_drafts_trees_exactly():
    target = tiny("decoder_only", seed=5)
    prompts = repetitive_prompts(6, seed=3)
    engine = Engine(target, NGramProposer(num_draft_tokens=6), TREE, max_batch_size=2)
    got = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_new_tokens=20 + i), request_id=i)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert got[i] == autoregressive_generate(target, prompt, 20 + i)


def test_a_recurrent_target_keeps_chains_and_says_so_once():
    target = tiny("s4d", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine(target, NGramProposer(), TREE)
    assert not engine.trees
    assert [str(w.message) for w in caught] == [
        "tree_top_k=3: the target S4DLM cannot verify token trees (recurrent models cannot branch in one forward); "
        "this engine drafts chains"]
    prompts = repetitive_prompts(2)
    decoder = SpeculativeDecoder(target, NGramProposer(num_draft_tokens=6), TREE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert decoder.generate(prompts, 12) == autoregressive_generate(target, prompts, 12)


def test_chains_stay_the_default():
    target = tiny("decoder_only", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(target, NGramProposer(), SpeculativeConfig())
    assert not engine.trees and engine.widest_draft == 4


# --- sampling: G-tests ---------------------------------------------------------------------

from speculative.core.sampling import probabilities  # noqa: E402
from speculative.core.verify import tree_rejection_walk  # noqa: E402
from tests.test_lossless import DRAWS, LENGTH, P_MIN, VOCAB, exact_joint, g_test_pvalue  # noqa: E402

V = 6


def markov(seed, sharp):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=gen) * sharp).softmax(-1)  # row: the previous token


def wrong_walk(tree, draft_probs, target_probs, generator):
    """A deliberately wrong rule (the negative control): every child is tried against the
    target's own p, never the residual, so drafted tokens come out too often."""
    children = tree.children()
    node, path = 0, []
    while True:
        p = target_probs[node]
        for child in children[node]:
            x = tree.tokens[child]
            qx = 1.0 if draft_probs is None else float(draft_probs[child, x])
            if float(torch.rand(1, generator=generator)) * qx < float(p[x]):
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        node = child + 1


def two_tokens(walk, sampled, draws=DRAWS, seed=0):
    """Counts of the first two emitted tokens after token 0 under target P, with a depth-2
    tree of two children per node: drawn i.i.d. from the draft's Q (sampled) or Q's top 2
    (deterministic). A path that ends early is continued by plain sampling from P."""
    P, Q = markov(1, 1.0), markov(2, 1.5)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V)
    for _ in range(draws):
        if sampled:
            first = torch.multinomial(Q[0], 2, replacement=True, generator=gen).tolist()
            second = [torch.multinomial(Q[t], 2, replacement=True, generator=gen).tolist() for t in first]
        else:
            first = Q[0].topk(2).indices.tolist()
            second = [Q[t].topk(2).indices.tolist() for t in first]
        tree = Tree(first + second[0] + second[1], [-1, -1, 0, 0, 1, 1])
        q = None if not sampled else torch.stack([Q[0], Q[0]] + [Q[first[0]]] * 2 + [Q[first[1]]] * 2)
        p = P[[0] + tree.tokens]  # (1+N, V): node i's distribution follows its own token
        path, extra = walk(tree, q, p, gen)
        emitted = [tree.tokens[i] for i in path] + [extra]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(P[emitted[0]], 1, generator=gen)))
        counts[emitted[0] * V + emitted[1]] += 1
    return counts, (P[0][:, None] * P).flatten()


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled children", "top-k children"])
def test_tree_sampling_is_exact(sampled):
    counts, exact = two_tokens(tree_rejection_walk, sampled)
    assert g_test_pvalue(counts, exact) > P_MIN


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled children", "top-k children"])
def test_the_g_test_catches_a_wrong_tree_rule(sampled):
    counts, exact = two_tokens(wrong_walk, sampled, draws=DRAWS // 4)  # caught even with a quarter of the draws
    assert g_test_pvalue(counts, exact) < P_MIN


@pytest.mark.slow
@pytest.mark.parametrize("source", ["draft model", "draft model + ngram"])  # "ngram" alone passes too (30 s more)
def test_engine_trees_sample_the_target_distribution(source):
    """End to end, seeded sampled requests: the draft model's trees (its top-k children), and
    lookup trees on a repetitive prompt with the draft model's trees where lookup finds no
    preferred match."""
    target = sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 12.0)
    prompt = [1, 5, 2, 1, 5, 3, 1, 5, 2, 1, 5]
    config = SpeculativeConfig(adaptive=False, greedy_verification=False, num_draft_tokens=3, tree_top_k=3,
                               tree_max_tokens=6, prompt_lookup=source == "draft model + ngram")
    draft = NGramProposer(num_draft_tokens=3) if source == "ngram" else \
        sharpen(tiny("decoder_only", vocab=VOCAB, seed=12), 12.0)
    decoder = SpeculativeDecoder(target, draft, config)
    counts = torch.zeros(VOCAB ** LENGTH)
    for start in range(0, DRAWS, 5_000):
        outs = decoder.generate([prompt] * 5_000, LENGTH, seeds=list(range(start, start + 5_000)))
        counts += torch.bincount(torch.tensor([o[0] * VOCAB ** 2 + o[1] * VOCAB + o[2] for o in outs]),
                                 minlength=VOCAB ** LENGTH)
    assert decoder.stats.drafted > 0 and 0 < decoder.acceptance_rate() < 1
    assert g_test_pvalue(counts, exact_joint(target, config, prompt)) > P_MIN


# --- the suffix cache ----------------------------------------------------------------------

from speculative import SuffixProposer  # noqa: E402
from speculative.proposers.suffix import SuffixCache  # noqa: E402


def run_engine(engine, prompts, budget):
    """Each prompt in turn through a long-lived engine; per prompt its tokens and forwards."""
    results = []
    for prompt in prompts:
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=budget))
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        results.append((tokens, engine.request_stats(rid).target_forwards))
    return results


@pytest.mark.parametrize("config", [TREE, SpeculativeConfig(num_draft_tokens=6, adaptive=False)],
                         ids=["trees", "chains"])
def test_a_repeated_prompt_drafts_its_earlier_output(config):
    target = tiny("decoder_only", seed=6)
    prompt = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()[:12]  # no repeats of its own
    other = torch.randperm(64, generator=torch.Generator().manual_seed(2)).tolist()[:12]
    reference = autoregressive_generate(target, prompt, 30)
    engine = Engine(target, SuffixProposer(num_draft_tokens=6), config, max_batch_size=2)
    (first, _), (_, _), (second, forwards) = run_engine(engine, [prompt, other, prompt], 30)
    assert first == second == reference
    assert forwards <= 7  # 30 tokens drafted 6 at a time from the first pass (plain: 30 forwards)
    fresh = Engine(target, SuffixProposer(num_draft_tokens=6), config, max_batch_size=2)
    assert run_engine(fresh, [prompt], 30)[0][1] > forwards  # a new engine knows nothing of it


def test_engines_never_share_a_cache():
    target = tiny("decoder_only", seed=6)
    prompt = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()[:12]
    proposer = SuffixProposer(num_draft_tokens=6)
    one, two = Engine(target, proposer, TREE), Engine(target, proposer, TREE)
    run_engine(one, [prompt], 30)
    assert one.proposer.cache.tokens == 42 and two.proposer.cache.tokens == 0 and proposer.cache.tokens == 0
    assert run_engine(two, [prompt], 30)[0][1] > run_engine(one, [prompt], 30)[0][1]


def test_the_cache_stays_bounded_and_evicts_the_oldest():
    cache = SuffixCache(max_tokens=100, min_n=1, max_n=3)
    gen = torch.Generator().manual_seed(0)
    first = [100, 101, 102, 103]
    cache.add(first)
    assert [seq[end:end + 2] for seq, end in cache.occurrences((100, 101))] == [[102, 103]]
    for _ in range(200):
        cache.add(torch.randint(0, 50, (30,), generator=gen).tolist())
        assert cache.tokens <= 100 and cache.entries <= 2 * 3 * 100 + 3 * 30
    assert len(cache.sequences) <= 4
    assert cache.occurrences((100, 101)) == []  # evicted with its sequence
    assert sum(map(len, cache.index.values())) == cache.entries


def test_suffix_chains_follow_the_longest_agreeing_context_else_the_most_frequent_branch():
    proposer = SuffixProposer(max_ngram=2, num_draft_tokens=2)
    proposer.cache.add([7, 0, 1, 2, 3, 4])
    row = [6, 0, 1, 2, 5, 5, 9, 7, 0, 1, 2]  # "1 2" after "0" in the row; after "7 0" in the cache
    proposer.add_rows([row])
    assert proposer.free_drafts([row], [2]) == ([[3, 4]], [True])
    # Every match agrees as far (only "1 2"): the most frequent branch, not the most recent.
    proposer = SuffixProposer(max_ngram=2, num_draft_tokens=2)
    row = [3, 1, 2, 8, 4, 1, 2, 8, 5, 1, 2, 9, 6, 1, 2]
    proposer.add_rows([row])
    assert proposer.free_drafts([row], [2]) == ([[8, 5]], [True])


def test_suffix_trees_are_greedy_exact_in_ragged_batches():
    target = tiny("decoder_only", seed=8)
    prompts = repetitive_prompts(4, seed=9)
    budgets = [25, 9, 30, 17]
    expected = autoregressive_generate(target, prompts, budgets)
    engine = Engine(target, SuffixProposer(num_draft_tokens=6), TREE, max_batch_size=3)
    for round_ in range(2):  # the second round drafts from the first round's outputs too
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=budget), request_id=f"{round_}-{i}")
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert [got[f"{round_}-{i}"] for i in range(4)] == expected


def test_the_command_line_drafts_trees(capsys):
    from speculative.entrypoints.cli import main

    for draft in ("ngram", "suffix", "default-draft+ngram", "default-draft", "default-head"):
        assert main(["generate", "--draft", draft, "--tree-top-k", "3", "--tree-max-tokens", "8",
                     "--max-new-tokens", "24", "--prompt", "x = [1, 2, 3]\nx = [1, 2, 3]\n"]) == 0
        assert "24 tokens in" in capsys.readouterr().out


def test_bench_compares_trees_with_chains_of_the_same_width():
    from speculative.entrypoints.bench import run_bench

    target = tiny("decoder_only", seed=0)
    draft = perturbed(target, 0.3, seed=1)
    report = run_bench(target, {"d": draft}, repetitive_prompts(2), max_new=12, runs=1, ks=(4,), adaptive=False,
                       peers=False, tree=(2, 6), log=lambda *a: None)
    methods = {m["name"]: m for m in report["methods"]}
    assert list(methods) == ["autoregressive", "d K=4", "ngram K=4", "ngram chain K=6", "ngram tree top-2 6 nodes",
                             "d chain K=6", "d tree top-2 6 nodes"]
    assert methods["d tree top-2 6 nodes"]["acceptance_per_depth"]
    assert all(m["identical"] for m in report["methods"][1:])
    assert methods["ngram tree top-2 6 nodes"]["acceptance_per_depth"]


@pytest.mark.parametrize("vocab", [None, list(range(0, 64, 2))], ids=["full vocabulary", "reduced vocabulary"])
def test_draft_model_trees_are_greedy_exact_in_ragged_batches(vocab, kept_paths):
    """EAGLE-2 expansion from a draft model alone (its reduced vocabulary too): the target's
    own output, paths kept off a node's first child, and more tokens per target forward
    than the draft's chains of the same depth."""
    target = sharpen(tiny("decoder_only", seed=0), 4.0)
    draft = perturbed(target, 0.3, seed=1)
    prompts, budgets = repetitive_prompts(4, seed=2), [30, 5, 17, 1]
    expected = autoregressive_generate(target, prompts, budgets)
    alone = dict(adaptive=False, prompt_lookup=False)  # the draft model's own trees
    chain = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=4, **alone), draft_vocab=vocab)
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=4, tree_top_k=3, tree_max_tokens=10,
                                                                  **alone), draft_vocab=vocab)
    assert decoder.generate(prompts, budgets) == expected and chain.generate(prompts, budgets) == expected
    assert any(off_first_branch(tree, path) for tree, path in kept_paths)
    if vocab is not None:
        assert all(t % 2 == 0 for tree, _ in kept_paths for t in tree.tokens)
    per_forward = lambda d: d.stats.generated / d.stats.target_forwards  # noqa: E731
    assert per_forward(decoder) > per_forward(chain)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_draft_scores_each_tree_node_as_its_path_read_alone(kind):
    """A draft model reads its tree over several forwards, each layer masked to the nodes
    read before: every node's logits equal those of its path appended to the prompt alone."""
    from speculative.proposers import DraftModelProposer
    from speculative.core.sampling import GREEDY

    model = MODELS[kind]()
    proposer = DraftModelProposer(model).fork()
    prompts = repetitive_prompts(2, seed=4)
    proposer.add_rows(prompts, 128, [GREEDY] * 2, [torch.Generator(), torch.Generator()])
    layers, forward = [], proposer._tree_forward

    def recording(tokens, parents, positions, mask):
        logits = forward(tokens, parents, positions, mask)
        layers.append((tokens.tolist(), parents.tolist(), logits))
        return logits

    proposer._tree_forward = recording
    trees = proposer.propose_tree(prompts, [4, 3], 3, 10)
    assert len(layers) == 3 and list(map(len, trees)) == [10, 10]
    assert max(trees[0].depths()) <= 4 and max(trees[1].depths()) <= 3
    for b, prompt in enumerate(prompts):
        read = []  # the path of every node read, in reading order
        for tokens, parents, logits in layers:
            for j, (token, parent) in enumerate(zip(tokens[b], parents[b])):
                read.append(([] if parent < 0 else read[parent]) + [token])
                alone = model.forward(torch.tensor([prompt + read[-1]]), model.new_state(1, 64))[0, -1]
                torch.testing.assert_close(logits[b, j], alone, atol=1e-4, rtol=1e-4)


def test_a_draft_model_behind_lookup_trees_is_exact():
    """MODEL+ngram: rows with a lookup tree take it, the draft model chains for the others."""
    target, draft = tiny("decoder_only", seed=0), tiny("decoder_only", seed=1)
    config = SpeculativeConfig(num_draft_tokens=6, tree_top_k=3, tree_max_tokens=12, adaptive=False,
                               prompt_lookup=True)
    prompts = repetitive_prompts(3, seed=5) + [list(range(10, 20))]
    decoder = SpeculativeDecoder(target, draft, config)
    assert decoder.generate(prompts, 20) == autoregressive_generate(target, prompts, 20)
