"""Writes the benchmark workloads (JSONL prompt files) from this interpreter's standard library.

    python benchmarks/make_workloads.py

- code_completion.jsonl: held-out modules, each cut right after a function's first line
  (the shipped pair never saw these files);
- grounded_editing.jsonl: long input-grounded prompts (edit a given function, quote a
  given text, answer from a given document), 500 to 2,000 Gemma tokens;
- mixed.jsonl: easy prompts (code that repeats itself) alternating with hard ones
  (English prose, which the code-trained pair predicts poorly).
"""

import json
import re
from pathlib import Path

from speculative.train import corpus

HERE = Path(__file__).parent


def write(name, rows):
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{name}: {len(rows)} prompts")


def functions(path, min_lines=12, max_chars=4000):
    """Top-level functions and methods of a file with at least `min_lines` lines."""
    text = corpus.read_text(path)
    found = []
    for match in re.finditer(r"^( *)def \w+\(.*?\):\n(?:\1 .*\n|\n)+", text, flags=re.M):
        body = match.group(0).rstrip() + "\n"
        if min_lines <= body.count("\n") and len(body) <= max_chars:
            found.append(body)
    return found


def region(text, low, high):
    """Whole lines from the first top-level `def`, between `low` and `high` characters long."""
    start = text.index("\ndef ") + 1
    lines, size = [], 0
    for line in text[start:].splitlines(keepends=True):
        if size + len(line) > high or (size >= low and line.startswith("def ")):
            break
        lines.append(line)
        size += len(line)
    return "".join(lines)


def code_completion():
    _, held_out = corpus.split_files()
    return [{"prompt": p, "kind": "code"} for p in corpus.function_prompts(held_out, 10)]


def grounded_editing():
    root = corpus.stdlib_root()
    rows = []
    for name, old, new in [("textwrap.py", "text", "content"), ("getopt.py", "args", "arguments"),
                           ("fnmatch.py", "pat", "pattern"), ("colorsys.py", "maxc", "max_component")]:
        body = region(corpus.read_text(root / name), 2500, 5000)
        prompt = (f"Here is some Python code:\n\n{body}\n"
                  f"The same code, with every `{old}` renamed to `{new}` and nothing else changed:\n\n")
        rows.append({"prompt": prompt, "kind": "edit"})
    readme = corpus.read_text(root / "json" / "__init__.py").split('"""')[1][:6000]
    rows.append({"prompt": f"Document:\n{readme}\n\nQuote the part of the document that shows how to "
                           "decode JSON, word for word:\n", "kind": "quote"})
    doc = corpus.read_text(root / "argparse.py").split('"""')[1][:6000]
    rows.append({"prompt": f"Document:\n{doc}\n\nQuestion: which classes does the module provide, and what "
                           "does each do? Answer using the document's own words.\nAnswer:", "kind": "answer"})
    return rows


def mixed():
    _, held_out = corpus.split_files()
    easy = []
    for path in held_out:
        for body in functions(path, min_lines=8, max_chars=1500):
            lines = body.splitlines(keepends=True)
            # The function once in full, then its first lines again: the rest repeats it.
            easy.append("".join(lines) + "\n\n# Again, unchanged:\n" + "".join(lines[:2]))
            break
        if len(easy) == 4:
            break
    hard = ["The weather in the mountains changed quickly that afternoon, and the hikers",
            "In the old library at the end of the street, the librarian kept a list of",
            "Dear committee members, thank you for the invitation to speak about the history of",
            "The recipe calls for two cups of flour, a pinch of salt, and"]
    rows = []
    for e, h in zip(easy, hard):
        rows += [{"prompt": e, "kind": "easy"}, {"prompt": h, "kind": "hard"}]
    return rows


if __name__ == "__main__":
    write("code_completion.jsonl", code_completion())
    write("grounded_editing.jsonl", grounded_editing())
    write("mixed.jsonl", mixed())
