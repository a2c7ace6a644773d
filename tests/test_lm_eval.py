"""lm-evaluation-harness's `local-completions` against a real `speculative serve` (the shipped
pair), as evaluation users run it: its command line, a task of our own read from local files
(the Hub cannot be reached here), the shipped tokenizer. Multiple choice scores each choice
from the prompt logprobs of `echo` (one request per choice, token ids as the prompt); they
must be the target's own log-likelihoods. Generation must be the target's greedy text."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from speculative import autoregressive_generate, load_model, load_tokenizer
from speculative.models.loading import ASSETS
from tests.serving import Server

pytestmark = [pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                 reason="the shipped models are not in this checkout"), pytest.mark.slow]
pytest.importorskip("lm_eval")

DOCS = [{"question": "def read_lines(path):\n    with open(path) as f:\n        return",
         "choices": [" f.readlines()", " 42", " None"], "answer": 0},
        {"question": "for i in range(10):\n    print(", "choices": ["i)", "range)", "))"], "answer": 0},
        {"question": "import os\nimport", "choices": [" sys", " 3", " ("], "answer": 0}]
TASKS = """task: speculative_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GENERATE = """task: speculative_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""


def samples(folder, task: str) -> list[dict]:
    files = list(folder.rglob(f"samples_{task}_*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def test_local_completions_scores_the_targets_loglikelihoods_and_greedy_text(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "choice.yaml").write_text(TASKS.format(data=data))
    (tasks / "generate.yaml").write_text(GENERATE.format(data=data))
    server = Server("--draft", "default-draft").wait_healthy()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=default,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
             f"tokenizer={ASSETS},num_concurrent=2,max_retries=1", "--tasks", "speculative_choice,speculative_generate",
             "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), "--log_samples"],
            capture_output=True, text=True, timeout=900, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                                              **os.environ})
    finally:
        assert server.stop() == 0
    assert run.returncode == 0, run.stderr[-3000:]

    target, tokenizer = load_model("default"), load_tokenizer("default")
    choice, generate = (samples(tmp_path / "out", f"speculative_{task}") for task in ("choice", "generate"))
    assert len(choice) == len(generate) == len(DOCS)
    for sample in choice:
        doc = sample["doc"]
        context = tokenizer.encode(doc["question"])
        for option, (scored, _) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            continuation = tokenizer.encode(doc["question"] + option)[len(context):]
            ids = torch.tensor([context + continuation])
            with torch.inference_mode():
                logits = target.forward(ids, target.new_state(1, ids.shape[1])).float().log_softmax(-1)
            own = sum(float(logits[0, len(context) - 1 + i, token]) for i, token in enumerate(continuation))
            assert float(scored) == pytest.approx(own, abs=1e-3), (doc["question"], option)
    for sample in generate:
        prompt = tokenizer.encode(sample["doc"]["question"])
        greedy = tokenizer.decode(autoregressive_generate(target, prompt, 16))
        assert sample["resps"][0][0] == greedy.split("\n\n")[0]
