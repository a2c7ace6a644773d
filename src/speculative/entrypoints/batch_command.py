"""`speculative batch`: its options, and the job in this process or on Ray (batch, batch_ray)."""

from __future__ import annotations

import sys

from ..core.config import MAX_NEW_TOKENS
from .cli_checks import integer
from .engine_args import EngineArgs


def add_batch(sub) -> None:
    p = sub.add_parser("batch", help="generate for every record of a JSONL or Parquet file, resumably, "
                       "in this process or on a Ray cluster",
                       description="Generate for every record of INPUT and append one JSON line per record id to "
                                   "OUTPUT: id, text, token_ids, finish_reason, drafted, accepted, target_forwards, or "
                                   "an error saying what was wrong with that record. Records are {\"id\", \"prompt\"} "
                                   "(text or token ids) or {\"id\", \"messages\"}, with optional max_tokens, "
                                   "temperature, seed and stop (strings). Rerunning the command skips the ids already "
                                   "in OUTPUT, and warns of those whose request changed in INPUT since (each line "
                                   "carries a request_hash) or that INPUT no longer holds. A job locks OUTPUT (the "
                                   "file OUTPUT.lock names its pid): a second job on it is refused. Exit status 2 "
                                   "when every record failed or OUTPUT is in use.")
    p.add_argument("input", help="records: a .jsonl file (one JSON object per line) or a .parquet file")
    p.add_argument("output", help="output .jsonl file; appended to, and resumed from when it exists")
    p.add_argument("--max-new-tokens", type=integer(0, MAX_NEW_TOKENS), default=128, help="for records without "
                   "max_tokens (default: %(default)s)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help="run on Ray: Ray "
                   "Data reads INPUT and an actor pool generates (one engine per actor). Without ADDRESS a local "
                   "cluster sized to this machine is started; with ADDRESS (host:port) an existing one is joined. "
                   "Needs speculative[ray]")
    p.add_argument("--actors", type=integer(1), default=None, help="with --ray: actors, each with its own models "
                   "(default: the cluster's CPUs / --threads-per-actor)")
    p.add_argument("--threads-per-actor", type=integer(1), default=1, help="with --ray: CPUs each actor "
                   "reserves and torch threads it runs (default: %(default)s)")
    p.add_argument("--redo-changed", action="store_true", help="answer again the ids of OUTPUT whose request "
                   "(prompt, messages or sampling settings) changed in INPUT since they were answered: their old "
                   "lines are removed (OUTPUT is rewritten whole, then renamed into place)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_to_parser(p, sampling="temperature", batching=True)
    p.set_defaults(run=run_batch)


def run_batch(args) -> int:
    from .batch import ModelSpec, run_local

    if args.ray is None and (args.actors is not None or args.threads_per_actor != 1):
        raise ValueError("--actors and --threads-per-actor apply with --ray")
    spec = ModelSpec.from_args(args)
    if args.ray is None:
        summary = run_local(args.input, args.output, spec, show_progress=not args.no_progress,
                            redo_changed=args.redo_changed)
    else:
        from .batch_ray import run_ray

        address = None if args.ray == "local" else args.ray
        summary = run_ray(args.input, args.output, spec, address=address, actors=args.actors,
                          threads=args.threads_per_actor, show_progress=not args.no_progress,
                          redo_changed=args.redo_changed)
    print(summary.line(), file=sys.stderr)
    if not summary.records:
        print(f"nothing to do: every id of {args.input} is in {args.output} already", file=sys.stderr)
    summary.check()
    return 0
