"""The screened output layer (models/argmax_screen.py): greedy rows' argmax from an int8 screen
and exact scores of its candidates. The argmax must be that of the float32-rounded exact
logits, ties to the lowest token, at every width; the bound it rests on must hold; the
compiled parts give the same bits on every instruction set; and decoding through it equals
decoding without it."""

import pytest
import torch

from speculative import (Engine, NGramProposer, SamplingParams, SpeculativeConfig, SpeculativeDecoder,
                         autoregressive_generate, load_model, save_model)
from speculative.models import argmax_screen
from speculative.models.loading import load_draft
from speculative.models.argmax_screen import _SCREENS as screens
from speculative.models.argmax_screen import (ROUNDING, ArgmaxScreen, activation_residual, screen_pays,
                                              screened_logits)
from tests.helpers import kernel_isas, tiny

V, H = 6000, 96


def exact_argmax(weight, hidden):
    """The reference: float64 logits rounded to float32, argmax (the lowest token at ties)."""
    return (hidden.double() @ weight.double().T).float().argmax(-1)


class Counted(ArgmaxScreen):
    """A screen that counts the calls that went through it."""

    calls = 0

    def logits(self, hidden):
        self.calls += 1
        return super().logits(hidden)


def layer_and_states(seed=0, rows=64):
    """A weight with rows of different scales and a few duplicated rows (exact ties), and hidden
    states with outlier channels (as final norms make them), some of them near-ties: the
    top token's row copied with one element nudged by an ulp."""
    torch.manual_seed(seed)
    weight = torch.randn(V, H) * torch.rand(V, 1) * 0.2
    weight[100] = weight[4000]  # the same scores: the argmax must be token 100
    hidden = torch.randn(rows, H) * (1 + 30 * (torch.rand(H) < 0.05))
    top = exact_argmax(weight, hidden)
    for row in range(0, rows, 4):  # a rival token one step from the best
        rival = (int(top[row]) + 17) % V
        weight[rival] = weight[top[row]]
        weight[rival, 0] = torch.nextafter(weight[rival, 0], torch.tensor(float("inf")))
    hidden[-1] = weight[100] * 3  # token 100 and its copy 4000 lead
    return weight, hidden


def test_the_argmax_is_the_float32_rounded_exact_one_at_every_width(ops):
    weight, hidden = layer_and_states()
    screen = ArgmaxScreen(weight)
    expected = exact_argmax(weight, hidden)
    assert int(expected[-1]) == 100
    whole = screen.logits(hidden)
    assert torch.equal(whole.argmax(-1), expected)
    assert (torch.isfinite(whole).sum(-1) < V // 10).all()  # a screen, not the whole layer
    for width in (1, 3, 17):  # each row alone or among others: the same finite scores, bit for bit
        parts = torch.cat([screen.logits(hidden[i:i + width]) for i in range(0, len(hidden), width)])
        finite = torch.isfinite(whole)
        assert torch.equal(parts.argmax(-1), expected)
        assert torch.equal(parts[finite & torch.isfinite(parts)], whole[finite & torch.isfinite(parts)])
    batched = screen.logits(hidden.reshape(4, 16, H))  # (B, T, H) in, (B, T, V) out
    assert batched.shape == (4, 16, V) and torch.equal(batched.argmax(-1).flatten(), expected)


def test_a_bound_too_tight_misses_the_argmax(ops):
    """The negative control: with the bound's weight terms at zero, the screen keeps only its
    own best token and near-ties go wrong."""
    weight, hidden = layer_and_states(seed=1, rows=128)
    screen = ArgmaxScreen(weight)
    screen.weight_error.zero_()
    screen.weight_norm.zero_()
    screen.widest_error = (0.0, 0.0)
    assert not torch.equal(screen.logits(hidden).argmax(-1), exact_argmax(weight, hidden))


def test_the_bound_holds_for_every_token(ops):
    """|exact - screen| <= the bound, for every token of every row."""
    weight, hidden = layer_and_states(seed=2, rows=16)
    screen = ArgmaxScreen(weight)
    exact = (hidden.double() @ weight.double().T).float().double()
    residual = activation_residual(hidden)
    scores = screen.int8(hidden).double()
    bound = screen.weight_error * hidden.double().norm(dim=-1, keepdim=True) \
        + screen.weight_norm * residual.norm(dim=-1, keepdim=True)
    assert ((exact - scores).abs() <= bound + ROUNDING * (scores.abs() + 2 * bound + 1)).all()
    assert ((exact - scores).abs() > bound / 50).any()  # not loose by orders of magnitude


def test_the_floor_is_the_exact_score_of_the_screens_best_token(ops):
    """Candidates are the tokens whose bound reaches the exact score of the screen's best
    token (less a rounding margin), not merely the screen's own lower bound for it, which
    sits about a bound lower and lets through many more. Checked on rows where that lower
    bound would let in tokens under the exact floor, so the test tells the two apart."""
    weight, hidden = layer_and_states(seed=7, rows=32)
    screen = ArgmaxScreen(weight)
    scores = screen.int8(hidden).double()
    bound = screen.weight_error * hidden.double().norm(dim=-1, keepdim=True) \
        + screen.weight_norm * activation_residual(hidden).norm(dim=-1, keepdim=True)
    bound = bound + ROUNDING * (scores.abs() + 2 * bound + 1)
    best = scores.argmax(-1, keepdim=True)
    exact = (hidden.double() * weight[best.squeeze(1)].double()).sum(-1, keepdim=True).float().double()
    floor = exact - ROUNDING * (exact.abs() + 1)
    reach = scores + bound
    looser = (reach >= scores.gather(1, best) - bound.gather(1, best)) & (reach < floor - 1e-6 * floor.abs())
    assert looser.sum() > len(hidden)  # the screen's own bound would let these in
    logits = screen.logits(hidden)
    assert not torch.isfinite(logits[looser]).any()
    assert (torch.isfinite(logits) & (reach < floor - 1e-6 * floor.abs())).sum() == 0
    assert torch.equal(logits.argmax(-1), exact_argmax(weight, hidden))


def test_the_residual_is_the_kernels_quantization(ops):
    """activation_residual quantizes as the int8 kernel does: the kernel's output for h equals
    the one for h - r (the part it keeps), bit for bit."""
    torch.manual_seed(3)
    hidden = torch.randn(8, H) * 5
    screen = ArgmaxScreen(torch.randn(64, H))
    kept = (hidden.double() - activation_residual(hidden)).float()
    assert torch.equal(screen.int8(hidden), screen.int8(kept))
    assert activation_residual(hidden).abs().max() <= hidden.abs().amax() / 254 * (1 + 1e-6)


def test_rows_with_nan_infinity_or_zeros(ops):
    """A NaN or infinite hidden state leaves no finite logit (the engine's non-finite check then
    ends the row); a zero one ties every token at 0, and the argmax is token 0."""
    weight, hidden = layer_and_states(seed=4, rows=4)
    hidden[0, 5], hidden[1, 7], hidden[2] = float("nan"), float("inf"), 0.0
    logits = ArgmaxScreen(weight).logits(hidden)
    assert not torch.isfinite(logits[0]).any() and not torch.isfinite(logits[1]).any()
    assert int(logits[2].argmax()) == 0 and torch.equal(logits[3].argmax(), exact_argmax(weight, hidden[3:]).squeeze())


def test_exact_scores_are_the_same_bits_on_every_instruction_set(ops):
    torch.manual_seed(5)
    weight, hidden = torch.randn(300, 203), torch.randn(7, 203)  # 203: lanes and a remainder
    rows, tokens = torch.randint(0, 7, (500,)), torch.randint(0, 300, (500,))
    isas = kernel_isas()
    results = [ops.exact_scores(weight, hidden, rows, tokens, isa) for isa in isas]
    assert all(torch.equal(result, results[0]) for result in results)
    reference = (weight[tokens].double() * hidden[rows].double()).sum(-1)
    torch.testing.assert_close(results[0].double(), reference, rtol=1e-7, atol=1e-9)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.exact_scores(weight, hidden, torch.tensor([7]), torch.tensor([0]), "auto")
    half = weight.bfloat16()  # read as it is: the bits of its float32 copy
    for isa in isas:
        assert torch.equal(ops.exact_scores(half, hidden, rows, tokens, isa),
                           ops.exact_scores(half.float(), hidden, rows, tokens, isa))


def test_screened_head_mixes_greedy_and_full_rows(ops):
    """Rows not asked for their argmax get the layer's own logits, bit for bit."""
    weight, hidden = layer_and_states(seed=6, rows=12)
    layer = torch.nn.Linear(H, V, bias=False)
    layer.weight.data = weight
    screens[layer] = ArgmaxScreen(weight)  # forced: the layer is below the size that pays
    states = hidden.reshape(3, 4, H)
    logits = screened_logits(layer, states, [True, False, True])
    assert torch.equal(logits[1], layer(states[1]))
    assert torch.equal(logits[[0, 2]].argmax(-1).flatten(), exact_argmax(weight, states[[0, 2]].reshape(-1, H)))


def test_large_float32_and_bfloat16_layers_only(ops, monkeypatch):
    big = torch.nn.Linear(640, 1 << 16, bias=False)  # 42M weights: screened
    assert screen_pays(big)
    assert not screen_pays(torch.nn.Linear(640, 1000))  # small: the layer is cheap
    assert screen_pays(big.to(torch.bfloat16))
    assert not screen_pays(big.to(torch.float16))
    monkeypatch.setenv("SPECULATIVE_ARGMAX_SCREEN", "0")
    assert not screen_pays(torch.nn.Linear(640, 1 << 16))


def test_a_bfloat16_layer_gets_the_exact_argmax_at_every_width(ops, monkeypatch):
    """The weight stays bfloat16 (no float32 copy); its screen is built in chunks and gives the
    argmax of the exact scores, where bfloat16-rounded logits would tie and take the lowest token."""
    monkeypatch.setattr(argmax_screen, "SCREEN_CHUNK", 1000)  # chunks and a remainder
    weight, hidden = layer_and_states(seed=9)
    weight, hidden = weight.bfloat16(), hidden.bfloat16()
    top = exact_argmax(weight.float(), hidden.float())
    for row in range(0, len(hidden), 4):  # a rival one bfloat16 step above the best in one weight
        rival = (int(top[row]) + 17) % V
        weight[rival] = weight[top[row]]
        channel = int(hidden[row].float().abs().argmax())
        value = weight[rival, channel].float()
        weight[rival, channel] = value + hidden[row, channel].float().sign() * value.abs() * 2 ** -7
    screen = ArgmaxScreen(weight)
    assert screen.weight.data_ptr() == weight.data_ptr()
    expected = exact_argmax(weight.float(), hidden.float())
    rounded = (hidden @ weight.T).float()  # bfloat16 logits: the rivals tie with the best there
    assert not torch.equal(rounded.argmax(-1), expected)
    for width in (1, 5, len(hidden)):
        parts = torch.cat([screen.logits(hidden[i:i + width]) for i in range(0, len(hidden), width)])
        assert torch.equal(parts.argmax(-1), expected)


def test_targets_get_their_screen_at_load_and_drafts_none(ops, tmp_path, monkeypatch):
    """load_model builds the screen (the first greedy request does not wait for it); load_draft
    never does (drafts never read it)."""
    monkeypatch.setattr(argmax_screen, "MIN_WEIGHTS", 0)  # every output layer pays
    save_model(tiny("decoder_only", vocab=512), tmp_path / "m")
    target = load_model(tmp_path / "m", dtype="bfloat16")
    assert isinstance(screens.get(target.lm_head), ArgmaxScreen)
    draft = load_draft(tmp_path / "m", dtype="bfloat16")
    assert draft.lm_head not in screens
    assert load_model(tmp_path / "m", dtype="bfloat16", pack=False).lm_head not in screens  # to save or train


def run(engine, requests):
    """Every request through the engine; its tokens by request id."""
    tokens = {}
    for request_id, (ids, params) in requests.items():
        engine.add_request(ids, params, request_id)
        tokens[request_id] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens


@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_through_the_screen_equals_decoding_without_it(ops, batch):
    """A tiny decoder with a screened head (forced: it is below the size that pays): plain and
    speculative greedy decoding through it equal plain decoding with the full layer."""
    model = tiny("decoder_only", vocab=512, seed=7)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6], [9, 9, 9, 9]][:batch]
    screens[model.lm_head] = None
    reference = autoregressive_generate(model, prompts, 24)
    screens[model.lm_head] = head = Counted(model.lm_head.weight)
    assert autoregressive_generate(model, prompts, 24) == reference
    assert head.calls > 0  # it ran
    head.calls = 0
    decoder = SpeculativeDecoder(model, NGramProposer(num_draft_tokens=6), SpeculativeConfig(num_draft_tokens=6))
    assert decoder.generate(prompts, 24) == reference
    assert head.calls > 0


def test_bfloat16_decoding_through_the_screen(ops):
    """A bfloat16 decoder with a screened head: speculative greedy output equals plain greedy
    output through the same screen, up to test_precision.py's near-ties (bfloat16 layers round
    a verify forward's rows differently from one-token forwards; the screen itself does not)."""
    from speculative.models import to_dtype
    from tests.test_precision import assert_within_policy

    model = to_dtype(tiny("decoder_only", vocab=512, seed=9), torch.bfloat16)
    screens[model.lm_head] = head = Counted(model.lm_head.weight)
    identical = 0
    for ids in ([1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6], [9, 9, 9, 9]):
        reference = autoregressive_generate(model, ids, 24)
        decoder = SpeculativeDecoder(model, NGramProposer(num_draft_tokens=6), SpeculativeConfig(num_draft_tokens=6))
        identical += assert_within_policy(model, ids, decoder.generate(ids, 24), reference)
    assert identical >= 2 and head.calls > 0


def test_a_sampled_row_beside_greedy_ones_gets_the_full_layer(ops):
    """In one engine batch, greedy rows through the screen and a seeded sampled row: each gets
    the tokens it gets with the screen off."""
    model = tiny("decoder_only", vocab=512, seed=8)
    requests = {"greedy": ([1, 2, 3, 1, 2], SamplingParams(20)),
                "sampled": ([4, 5, 4, 5], SamplingParams(20, temperature=0.9, seed=3)),
                "greedy too": ([7, 7, 8], SamplingParams(20))}
    outputs = []
    for head in (None, Counted(model.lm_head.weight)):
        screens[model.lm_head] = head
        engine = Engine(model, NGramProposer(num_draft_tokens=4), SpeculativeConfig(num_draft_tokens=4),
                        max_batch_size=3)
        outputs.append(run(engine, requests))
    assert outputs[0] == outputs[1]
    assert head.calls > 0
