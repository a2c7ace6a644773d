"""One decoder used from several threads at once, and several live streams on one decoder:
every call owns its rows and states, so each gives exactly what it gives alone."""

import threading

import pytest

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate
from tests.helpers import perturbed, sharpen, tiny

# (prompts, budgets, seeds)
CALLS = [([3, 1, 4, 1, 5], 30, [11]), ([[9, 2, 6], [5, 3, 5, 8, 9, 7]], [25, 18], [12, 13]),
         ([2, 7, 1, 8] * 3, 40, [14])]


def draft_of(kind, target):
    return {"decoder_only": perturbed(target, 0.05, seed=2), "s4d": sharpen(tiny("s4d", seed=3), 4.0),
            "ngram": NGramProposer(max_ngram=3)}[kind]


def in_threads(function, arguments):
    """Run function(*a) for every a at once (a barrier lines the threads up); results in order."""
    results, errors = [None] * len(arguments), []
    barrier = threading.Barrier(len(arguments))

    def run(i, args):
        try:
            barrier.wait()
            results[i] = function(*args)
        except Exception as error:  # reported below, with the thread's own traceback
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(arguments)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("draft_kind", ["decoder_only", "s4d", "ngram"])
def test_three_threads_with_seeded_sampling_give_the_tokens_of_sequential_calls(draft_kind):
    target = sharpen(tiny("decoder_only", seed=1), 4.0)
    config = SpeculativeConfig(greedy_verification=False, num_draft_tokens=3, prompt_lookup=draft_kind != "ngram")
    decoder = SpeculativeDecoder(target, draft_of(draft_kind, target), config)

    def generate(prompts, budgets, seeds):
        return decoder.generate(prompts, budgets, seeds=seeds)

    sequential = [generate(*call) for call in CALLS]
    generated = decoder.stats.generated
    for _ in range(3):  # several rounds: the threads interleave differently each time
        assert in_threads(generate, CALLS) == sequential
    assert decoder.stats.generated == 4 * generated  # every thread's tokens counted, none lost
    assert generate(CALLS[0][0], CALLS[0][1], [99]) != sequential[0]  # the seeds matter: no accident above


@pytest.mark.parametrize("draft_kind", ["decoder_only", "s4d"])
def test_threads_with_greedy_adaptive_decoding_give_the_reference(draft_kind):
    target = tiny("decoder_only", seed=4)
    decoder = SpeculativeDecoder(target, draft_of(draft_kind, target), SpeculativeConfig(num_draft_tokens=4))
    calls = [(call[0], call[1]) for call in CALLS]
    expected = [autoregressive_generate(target, *call) for call in calls]
    for _ in range(2):
        assert in_threads(decoder.generate, calls) == expected


@pytest.mark.parametrize("draft_kind", ["decoder_only", "s4d"])
def test_two_interleaved_streams_on_one_decoder(draft_kind):
    target = sharpen(tiny("decoder_only", seed=5), 4.0)
    config = SpeculativeConfig(greedy_verification=False, num_draft_tokens=3, seed=7)
    decoder = SpeculativeDecoder(target, draft_of(draft_kind, target), config)
    first, second = ([5, 6, 7, 8], 30), ([[1, 2], [3, 4, 5]], [20, 26])
    expected = [list(decoder.stream(*first)), list(decoder.stream(*second))]
    streams = [decoder.stream(*first), decoder.stream(*second)]
    got = [[], []]
    live = [True, True]
    while any(live):  # one token from each in turn: both generators stay open throughout
        for i, stream in enumerate(streams):
            if live[i]:
                token = next(stream, None)
                live[i] = token is not None
                if live[i]:
                    got[i].append(token)
    assert got == expected
    assert len(got[0]) == 30 and sorted(row for row, _ in got[1]) == [0] * 20 + [1] * 26
    greedy = SpeculativeDecoder(target, draft_of(draft_kind, target), SpeculativeConfig(num_draft_tokens=3))
    a, b = greedy.stream([5, 6, 7, 8], 30), greedy.stream([9, 9, 1], 25)
    pairs = [(next(a), next(b)) for _ in range(25)]
    assert next(b, None) is None
    assert [x for x, _ in pairs] + list(a) == autoregressive_generate(target, [5, 6, 7, 8], 30)
    assert [y for _, y in pairs] == autoregressive_generate(target, [9, 9, 1], 25)
