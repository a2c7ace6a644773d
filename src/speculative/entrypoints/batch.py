"""`speculative batch`: generation over a file of records, in this process or on Ray.

Each record (`batch_files` has the file formats and how a job resumes) is one request of a
step engine: {"id", "prompt"} (text or token ids) or {"id", "messages"} (a chat), with
optional `max_tokens`, `temperature`, `seed` and `stop` (strings). Its output line holds
id, text, token_ids, finish_reason ("length" or "stop") and its speculative figures
(drafted, accepted, target_forwards); a record that cannot be generated gets `error`
instead, saying what was wrong, and the job goes on. Every line also carries `request_hash`,
a short hash of the request it answers: a resumed job names the ids whose
request INPUT has changed since (or no longer holds), and answers the changed ones again
with `redo_changed`.

A `Worker` (models loaded once, one engine) turns records into output lines; this module
runs one in this process (`run_local`), `batch_ray` runs one per Ray actor. Output does not
depend on where a record ran: greedy records get the target's greedy tokens, seeded
sampled ones the same tokens in any batch (the engine keys random streams by request).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator

from ..core.config import MAX_NEW_TOKENS
from ..core.inputs import check_request_seed
from ..core.rows import SamplingParams
from .engine_args import EngineArgs

# Optional fields of a record; other keys are carried by datasets (labels, sources) and ignored,
# except settings that other front-ends take and records do not (refused: the record would be
# generated without them), with what to write instead.
FIELDS = ("max_tokens", "temperature", "seed", "stop")
NOT_RECORD_SETTINGS = {"max_new_tokens": 'write "max_tokens"', "max_completion_tokens": 'write "max_tokens"',
                       "chat": 'give "messages" for a chat', "top_k": "records sample from all tokens",
                       "top_p": "records sample from all tokens", "stop_token_ids": 'give "stop" strings'}


@dataclass
class ModelSpec(EngineArgs):
    """The engine options of a job (EngineArgs: picklable, every Ray actor builds its own
    engine from it) and the budget of records that give none (`temperature` is the
    temperature of records that give none)."""

    max_new_tokens: int = 128


def _json(value) -> str:
    return json.dumps(value, default=repr)[:80]


def request_of(record: dict, tokenizer, spec: ModelSpec,
               context: int | None = None) -> tuple[list[int], SamplingParams, tuple[str, ...]]:
    """(prompt ids, sampling params, stop strings) of one record; ValueError says what is wrong,
    in the record's own terms. `context`: the most tokens, prompt and output, the models hold."""
    has = {key: record.get(key) is not None for key in ("prompt", "messages", *FIELDS)}  # null = left out
    for key, instead in NOT_RECORD_SETTINGS.items():
        if record.get(key) is not None:
            raise ValueError(f"\"{key}\" is not a field of a record, which takes \"prompt\" or \"messages\", and "
                             f"{', '.join(map(json.dumps, FIELDS))}; {instead}")
    if has["prompt"] == has["messages"]:
        raise ValueError("a record needs either \"prompt\" (text or token ids) or \"messages\" (a chat), "
                         f"{'not both' if has['prompt'] else 'got neither'}")
    if has["prompt"]:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"\"prompt\" must be a string or a list of token ids, got {_json(prompt)}")
    else:
        ids = tokenizer.chat_messages(record["messages"])
    if not ids:
        raise ValueError("the prompt is empty (it encodes to no tokens)")
    max_tokens = record["max_tokens"] if has["max_tokens"] else spec.max_new_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"\"max_tokens\" must be an integer in 0..{MAX_NEW_TOKENS}, got {_json(max_tokens)}")
    if context is not None and len(ids) + max_tokens > context:
        raise ValueError(f"the prompt has {len(ids)} tokens and \"max_tokens\" is {max_tokens}: {len(ids) + max_tokens} "
                         f"tokens exceed the models' maximum length of {context}; allowed \"max_tokens\" <= "
                         f"{max(0, context - len(ids))}")
    temperature = record["temperature"] if has["temperature"] else spec.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"\"temperature\" must be a finite number >= 0 (0 = greedy), got {_json(temperature)}")
    seed = record.get("seed")
    check_request_seed(seed, '"seed"', _json)
    stop = record.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"\"stop\" must be a string or a list of non-empty strings, got {_json(record['stop'])}")
    params = SamplingParams(max_tokens, float(temperature), seed=seed,
                            stop_token_ids=tokenizer.eos_token_ids or None)
    return ids, params, tuple(stop)


def request_hash(record: dict, spec: ModelSpec) -> str:
    """A short hash of what decides a record's answer: its prompt or messages and its sampling
    settings, the job's defaults standing in for those it leaves out (null = left out, as
    in `request_of`). Ids and keys a record carries for datasets do not count; neither do
    the models. Well-formed or not: an edited bad record is a changed request too."""
    request = {key: record[key] for key in ("prompt", "messages", "seed") if record.get(key) is not None}
    request["max_tokens"] = record["max_tokens"] if record.get("max_tokens") is not None else spec.max_new_tokens
    temperature = record["temperature"] if record.get("temperature") is not None else spec.temperature
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    request["temperature"] = float(temperature) if number else temperature  # 1 and 1.0 ask the same
    stop = record.get("stop")
    if stop:
        request["stop"] = [stop] if isinstance(stop, str) else stop
    text = json.dumps(request, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def stop_cut(tokenizer, tokens: list[int], stops: tuple[str, ...], checked: int) -> tuple[int, str] | None:
    """Where the first stop string ends the output: (tokens kept, text before the stop) for
    the fewest tokens whose text holds a stop string, looking from token `checked` on.
    Independent of how many tokens each step gave, so of the batch a record ran in."""
    for n in range(max(1, checked), len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return n, text[:min(found)]
    return None


@dataclass
class Live:
    """A record the engine is generating."""

    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)


class Worker:
    """Records in, output lines out, on one engine: the models load once."""

    def __init__(self, spec: ModelSpec, clock: Callable[[], float] = time.perf_counter):
        self.spec = spec.validate()
        built = self.spec.build()
        self.engine, self.tokenizer, self.context = built.engine(), built.tokenizer, built.context
        self.clock = clock
        self.step_seconds = 0.0  # inside engine.step: what is not overhead

    def generate(self, records: Iterable[dict]) -> Iterator[dict]:
        """Output lines as records finish (a bad record's at once). The engine is kept fed:
        records are added while fewer than max_batch_size wait for a free row."""
        engine, waiting = self.engine, iter(records)
        live: dict[Hashable, Live] = {}
        more = True
        while True:
            while more and engine.num_waiting() < engine.max_batch_size:
                record = next(waiting, None)
                if record is None:
                    more = False
                    break
                try:
                    ids, params, stops = request_of(record, self.tokenizer, self.spec, self.context)
                    engine.add_request(ids, params, request_id=record["id"])
                    live[record["id"]] = Live(stops)
                except (ValueError, TypeError) as error:
                    yield {"id": record["id"], "error": str(error)}
            if not engine.has_unfinished():
                if more:
                    continue
                return
            started = self.clock()
            outputs = engine.step()
            self.step_seconds += self.clock() - started
            for output in outputs:
                row = live.get(output.request_id)
                if row is None:  # a record ended by a stop string, leaving the engine
                    continue
                done = len(row.tokens)
                row.tokens += output.new_token_ids
                cut = stop_cut(self.tokenizer, row.tokens, row.stops, done) if row.stops else None
                if cut is not None:
                    engine.abort(output.request_id)
                    yield self._finished(output.request_id, row.tokens[:cut[0]], "stop", cut[1])
                    del live[output.request_id]
                elif output.finished:
                    yield self._finished(output.request_id, row.tokens, output.finish_reason)
                    del live[output.request_id]

    def _finished(self, request_id, tokens: list[int], reason: str, text: str | None = None) -> dict:
        stats = self.engine.request_stats(request_id)
        return {"id": request_id, "text": self.tokenizer.decode(tokens) if text is None else text,
                "token_ids": tokens, "finish_reason": reason, "drafted": stats.drafted, "accepted": stats.accepted,
                "target_forwards": stats.target_forwards}


@dataclass
class Summary:
    """What a job did (this run only: ids skipped on resume are not counted)."""

    records: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    # Seconds from the job's start until its first record was written (start-up: models, Ray).
    first_record_seconds: float | None = None
    # Seconds from the job's start until every worker had its models loaded (for Ray: the
    # actors' own clocks, so on one machine, or on nodes whose clocks agree).
    ready_seconds: float | None = None
    # Seconds inside the engines' step calls, summed over workers.
    step_seconds: float = 0.0
    skipped: int = 0
    first_error: str | None = None
    workers: int = 1
    # Records written per Ray node id (empty in this process).
    nodes: dict = field(default_factory=dict)

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        where = f" on {self.workers} actors across {len(self.nodes)} nodes" if self.nodes else ""
        return (f"[{self.records} records ({self.errors} with errors, {self.skipped} already done), {self.tokens} "
                f"tokens in {self.seconds:.2f} s{where}: {rate:.1f} tokens/s]")

    def count(self, record: dict, started: float, now: float) -> None:
        self.records += 1
        if self.first_record_seconds is None:
            self.first_record_seconds = now - started
        if "error" in record:
            self.errors += 1
            self.first_error = self.first_error or f"id {_json(record['id'])}: {record['error']}"
        else:
            self.tokens += len(record["token_ids"])

    def check(self) -> "Summary":
        """A job whose records all failed is a failed job."""
        if self.records and self.errors == self.records:
            raise ValueError(f"all {self.records} records failed; the first: {self.first_error} (each record's "
                             "error is in its output line)")
        return self


def progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="records", disable=not enabled, dynamic_ncols=True)


CHANGED = "prompt, messages or sampling settings in {}, or this job's defaults for them"


def ids_of(count: int) -> str:
    return f"{count} id{'' if count == 1 else 's'}"


def some_ids(ids: list) -> str:
    """The first few of `ids`, and how many more."""
    shown = ", ".join(_json(i) for i in ids[:5])
    return shown + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def open_job(input_path, output_path, spec: ModelSpec, redo_changed: bool = False):
    """(the checked spec, the output file, a Summary counting records already done, the
    records left to run) of a job: what a local and a Ray run start from. The output file
    holds OUTPUT's lock (a second job is refused) until it is closed. Ids done whose request
    changed in INPUT since, or that INPUT no longer holds, are named on stderr; with
    `redo_changed` the changed ones lose their lines and run again."""
    from .batch_files import OutputFile, check_paths, pending, read_records

    check_paths(input_path, output_path)
    records = read_records(input_path)
    spec = spec.validate()
    output = OutputFile(output_path)
    try:
        output.request_hashes = {record["id"]: request_hash(record, spec) for _, record in records}
        changed = [i for i, digest in output.answered.items()
                   if digest is not None and i in output.request_hashes and digest != output.request_hashes[i]]
        removed = [i for i in output.answered if i not in output.request_hashes]
        if changed and redo_changed:
            print(f"redoing {ids_of(len(changed))} of {output_path} with an answer to a changed request "
                  f"({CHANGED.format(input_path)}): {some_ids(changed)}", file=sys.stderr)
            output.drop(set(changed))
        elif changed:
            print(f"warning: {ids_of(len(changed))} of {output_path} with an answer to a changed request "
                  f"({CHANGED.format(input_path)}): {some_ids(changed)}; the old answers are kept: rerun with "
                  "--redo-changed to answer again", file=sys.stderr)
        if removed:
            print(f"warning: {ids_of(len(removed))} of {output_path} no longer in {input_path} (their lines are "
                  f"kept): {some_ids(removed)}", file=sys.stderr)
    except BaseException:
        output.close()
        raise
    summary = Summary(skipped=len(output.done & output.request_hashes.keys()))
    return spec, output, summary, [record for _, record in pending(records, output.done)]


def run_local(input_path, output_path, spec: ModelSpec, show_progress: bool = True,
              clock: Callable[[], float] = time.perf_counter, redo_changed: bool = False) -> Summary:
    """The job in this process, on one engine, with a progress bar (records, tokens/s)."""
    spec, output, summary, todo = open_job(input_path, output_path, spec, redo_changed)
    started = clock()
    try:
        if todo:
            worker = Worker(spec, clock)
            summary.ready_seconds = clock() - started
            with progress(len(todo), show_progress) as bar:
                for record in worker.generate(todo):
                    if output.write(record):
                        summary.count(record, started, clock())
                        bar.update()
                        bar.set_postfix_str(f"{summary.tokens / max(clock() - started, 1e-9):.1f} tokens/s")
            summary.step_seconds = worker.step_seconds
    finally:
        output.close()
    summary.seconds = clock() - started
    return summary
