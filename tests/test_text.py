"""A checkpoint's tokenizer read by `tokenizers` alone (TextTokenizer.from_checkpoint) gives
what transformers' tokenizer gives: ids, texts, chat prompts, end-of-text ids; and when two
tokenizers count as one (`same_vocabulary`, the engine's check of a pair)."""

import json
import pickle
import random
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from speculative.models.text import TextTokenizer, same_vocabulary

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — 你好 🙂", "<s> special </s> in text", "  leading spaces",
         "", (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()[:3000]]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort this."},
            {"role": "assistant", "content": "sorted(x)"}, {"role": "user", "content": "Thanks"}]
# A template that writes the start token itself, as Gemma's does.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def assert_same(hf, fast):
    assert all(hf.encode(text) == fast.encode(text) for text in TEXTS)
    rng = random.Random(0)
    ids = [[rng.randrange(len(hf)) for _ in range(40)] for _ in range(20)] + [hf.encode(text) for text in TEXTS]
    assert all(hf.decode(row) == fast.decode(row) for row in ids)
    assert len(hf) == len(fast) and hf.vocab() == fast.vocab()
    assert hf.eos_token_ids == fast.eos_token_ids
    assert hf.has_chat_template() == fast.has_chat_template()
    if hf.has_chat_template():
        for prompt in (True, False):
            assert hf.chat_messages(MESSAGES, prompt) == fast.chat_messages(MESSAGES, prompt)


@pytest.fixture
def checkpoint_tokenizer(tmp_path):
    """The shipped tokenizer as a transformers checkpoint's: start and end tokens added to
    every text, and a chat template that writes the start token itself."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import processors

    backend = Tokenizer.from_file(str(Path(__file__).parents[1] / "src/speculative/assets/default/tokenizer.json"))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_a_checkpoint_tokenizer_without_transformers_gives_what_transformers_gives(checkpoint_tokenizer):
    from transformers import AutoTokenizer

    hf = TextTokenizer(AutoTokenizer.from_pretrained(str(checkpoint_tokenizer), local_files_only=True),
                       name="hf")
    fast = TextTokenizer.from_checkpoint(checkpoint_tokenizer)
    assert fast.encode("x")[0] == fast.backend.token_to_id("<s>")  # the start token is added, as by transformers
    assert fast.chat("hi").count(fast.backend.token_to_id("<s>")) == 1  # and not twice in a chat prompt
    assert_same(hf, fast)
    given = TextTokenizer.from_checkpoint(checkpoint_tokenizer, eos_token_ids=[3, 4])  # generation_config.json's
    assert given.eos_token_ids == [3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_preset_tokenizers_without_transformers_give_what_transformers_gives(preset):
    from transformers import AutoTokenizer

    from speculative.models.native import generation_eos
    from speculative.models.presets import directory

    try:
        path = directory(preset)
    except (ImportError, ValueError) as error:
        pytest.skip(f"{preset} is not installed: {error}")
    eos = generation_eos(path)
    hf = TextTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), name="hf", eos_token_ids=eos)
    assert_same(hf, TextTokenizer.from_checkpoint(path, eos))


def test_same_vocabulary_compares_every_token_once_per_pair_and_sees_added_ones(monkeypatch):
    """Every engine checks its pair's tokenizers: equal vocabularies match, one changed id or an
    added token does not; the answer is kept for the pair (the vocabularies are read once)
    until a vocabulary grows."""
    path = Path(__file__).parents[1] / "src/speculative/assets/default/tokenizer.json"
    a, b = (TextTokenizer(Tokenizer.from_file(str(path)), name) for name in ("a", "b"))
    reads = []
    read = TextTokenizer.vocab
    monkeypatch.setattr(TextTokenizer, "vocab", lambda self: reads.append(self.name) or read(self))
    assert same_vocabulary(a, b) and same_vocabulary(a, b) and reads == ["a", "b"]
    assert pickle.loads(pickle.dumps(a)).vocab() == read(a)  # tokenizers still travel (Ray, processes)
    b.backend.add_tokens(["<added>"])
    assert not same_vocabulary(a, b)
    a.backend.add_tokens(["<added>"])
    assert same_vocabulary(a, b)
    data = json.loads(path.read_text())
    vocab = a.backend.get_vocab()
    first, second = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens' ids swapped
    model = data["model"]["vocab"]
    model[first], model[second] = model[second], model[first]
    c = TextTokenizer(Tokenizer.from_str(json.dumps(data)), "c")
    c.backend.add_tokens(["<added>"])
    assert len(c) == len(a) and not same_vocabulary(a, c)
