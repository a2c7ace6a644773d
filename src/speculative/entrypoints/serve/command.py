"""`speculative serve`: its options, and running uvicorn with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops accepting connections and new requests, gives
what runs `--shutdown-grace` seconds to finish, aborts the rest (each stream still gets
its final chunk and `[DONE]`), and exits 0. Everything the options name (the address, the
chat template) is checked before a model loads; a port in use exits 3. The server logs a
line per request (`--no-access-log` turns that off) and a line when it shuts down.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from ..cli_checks import EXIT_STATUSES, BusyPort, integer, number
from ..engine_args import EngineArgs, describe_draft

log = logging.getLogger("speculative.serve")

NEEDS = ("fastapi", "uvicorn", "prometheus_client")
# --max-queued's default, per row of --max-batch-size: a queued request waits for at most
# about this many batches ahead of it before it starts.
QUEUED_PER_ROW = 8


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat) on the step engine",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                                   "(Prometheus) with continuous batching and speculative decoding. Greedy "
                                   "requests get exactly the target's own greedy tokens. Needs the serve extra: "
                                   "pip install 'speculative[serve]'. " + EXIT_STATUSES)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=integer(1, 65535), default=8000, help="port, 1..65535; one in use exits with "
                   "status 3 (default: %(default)s)")
    p.add_argument("--max-queued", type=integer(0), default=None, metavar="N",
                   help="requests that may wait for a row (the running batch is --max-batch-size); one more is "
                   "refused at once with 429, an OpenAI error body (code queue_full) and Retry-After, so a "
                   "burst of any size holds at most --max-batch-size plus N requests. A queued request costs "
                   "only its prompt, but it waits for the rows ahead of it: past about 8 batches, a client is "
                   "better served by a quick 429 and a retry (or another server). 0: no queue, refuse whenever "
                   "every row is busy (default: 8 x --max-batch-size)")
    p.add_argument("--max-waiting", type=integer(0), dest="max_queued", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the older name of --max-queued, still taken
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, for a tokenizer without "
                   "one (or to replace its own)")
    p.add_argument("--max-body-bytes", type=integer(1), default=1 << 20, help="larger request bodies are refused "
                   "with 413 (default: %(default)s)")
    p.add_argument("--no-access-log", action="store_true", help="no log line per request on stderr")
    p.add_argument("--shutdown-grace", type=number(0), default=30.0, help="seconds running requests get to finish "
                   "after SIGTERM before they are aborted (default: %(default)s)")
    add_ray_options(p)
    EngineArgs.add_to_parser(p, batching=True, threads=True)
    p.set_defaults(run=run_serve)


def add_ray_options(p) -> None:
    """`serve --ray`: the same app as Ray Serve replicas (serve/ray_app.py)."""
    g = p.add_argument_group("Ray Serve (speculative[ray])")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help="serve through Ray "
                   "Serve: an ingress and engine replicas on the Ray cluster at ADDRESS ('auto': the one this "
                   "machine belongs to), or on a local one started for the command when none is given")
    g.add_argument("--replicas", type=replica_count, default=1, help="with --ray: engine replicas, an integer or "
                   "'auto' (autoscaled between --min-replicas and --max-replicas on ongoing requests, "
                   "--max-batch-size per replica) (default: %(default)s)")
    g.add_argument("--min-replicas", type=integer(1), default=1, help="with --replicas auto (default: %(default)s)")
    g.add_argument("--max-replicas", type=integer(1), default=2, help="with --replicas auto (default: %(default)s)")
    g.add_argument("--replica-cpus", type=integer(1), default=1, help="with --ray: CPUs each engine replica "
                   "reserves; its torch threads are --threads, else these (default: %(default)s)")
    g.add_argument("--router", choices=("prefix", "serve"), default="prefix", help="with --ray: how requests "
                   "choose an engine replica: 'prefix' (ours: a long shared prompt prefix goes where it went "
                   "before, while load allows) or 'serve' (Serve's default: the less busy of two at random) "
                   "(default: %(default)s)")
    g.add_argument("--print-config", action="store_true", help="with --ray: print the Serve config YAML of these "
                   "options (for `serve deploy` or a KubeRay RayService) and exit")


def replica_count(text: str):
    """--replicas: an integer >= 1 or 'auto'."""
    if text == "auto":
        return text
    try:
        return integer(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def check_installed() -> None:
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ImportError:
            return True

    missing = [name for name in NEEDS if absent(name)]
    if missing:
        raise ValueError(f"speculative serve needs {', '.join(missing)}, which is not installed: "
                         "pip install 'speculative[serve]'")


def check_address(host: str, port: int) -> None:
    """Before any model loads: `host` resolves to addresses of this machine, and `port` is
    free on each (bound and released at once, with the SO_REUSEADDR that uvicorn sets)."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as error:
        raise ValueError(f"--host {host!r} is not an address or a name this machine can resolve "
                         f"({getattr(error, 'strerror', None) or error})") from None
    for family, kind, proto, _, address in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (IPv6), skipped as asyncio skips it
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise BusyPort(f"port {port} on {host} is in use: stop what serves there, or give another "
                                   "--port") from None
                raise ValueError(f"cannot serve on --host {host} --port {port}: {error.strerror or error}"
                                 + (" (ports below 1024 need privileges)" if error.errno == errno.EACCES else "")
                                 ) from None


def read_template(option: str, path: str) -> str:
    """A Jinja chat template file, its syntax checked (before any model loads)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from ..prompt_files import read_text

    if not Path(path).is_file():
        raise FileNotFoundError(f"{option} {path} is not a file; give a Jinja template file")
    template = read_text(path, option)
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as error:
        raise ValueError(f"{option} {path} line {error.lineno} is not a Jinja template: {error.message}") from None
    return template


def check_template(option: str, path: str, tokenizer) -> None:
    """Render the chat template once, on one user turn: a template that cannot render it is
    refused at start-up, not on every chat request."""
    try:
        ids = tokenizer.chat_messages([{"role": "user", "content": "Hello"}])
    except Exception as error:  # whatever the template raises (undefined names, raise_exception)
        raise ValueError(f"{option} {path} cannot render a chat of one user turn: {type(error).__name__}: "
                         f"{error}") from None
    if not ids:
        raise ValueError(f"{option} {path} renders a chat of one user turn as no tokens")


def build_engine(args, engine_args: EngineArgs):
    """The engine, its tokenizer (with --chat-template) and the context every request must
    fit; the template is read and checked before a model loads."""
    template = None if args.chat_template is None else read_template("--chat-template", args.chat_template)
    built = engine_args.build()
    tokenizer = built.tokenizer
    tokenizer.chat_template = template or tokenizer.chat_template
    if template is not None:
        check_template("--chat-template", args.chat_template, tokenizer)
    return built.engine(), tokenizer, built.context


def warm_up(engine, tokenizer) -> None:
    """One short request before the port opens: the first client does not pay for first calls
    and the adaptive policy's cost measurement."""
    from ...core.rows import SamplingParams

    prompt = tokenizer.encode("def main():\n    return") or [0]
    engine.add_request(prompt, SamplingParams(max_new_tokens=8), "warm-up")
    while engine.has_unfinished():
        engine.step()


def run_serve(args) -> int:
    check_installed()
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; give a key, or leave the option out to serve without one")
    ray_only = [name for name, given in (("--replicas", args.replicas != 1), ("--replica-cpus", args.replica_cpus != 1),
                                         ("--router", args.router != "prefix"), ("--print-config", args.print_config))
                if given]
    if args.ray is None and ray_only:
        raise ValueError(f"{', '.join(ray_only)} apply with --ray")
    if args.ray is not None:
        try:
            from .ray_app import run_ray
        except ImportError as error:
            raise ValueError(f"--ray needs Ray Serve ({error}): pip install 'speculative[ray]'") from None
        return run_ray(args)
    check_address(args.host, args.port)
    import uvicorn

    from .app import Settings, create_app
    from .engine_loop import EngineLoop
    from .metrics import Metrics

    engine_args = EngineArgs.from_args(args).validate()
    if args.max_queued is None:
        args.max_queued = QUEUED_PER_ROW * engine_args.max_batch_size
    engine, tokenizer, context = build_engine(args, engine_args)
    warm_up(engine, tokenizer)
    loop = EngineLoop(engine, tokenizer.decode, Metrics(), args.max_queued)
    settings = Settings(args.served_model_name or args.target, context, args.api_key, args.max_body_bytes,
                        tuple(tokenizer.eos_token_ids), vocab_size=engine.target.vocab_size)
    app = create_app(loop, tokenizer, settings)
    setup_logging(args.no_access_log)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_grace + 30),
                            on_exit=lambda: loop.drain(args.shutdown_grace), grace=args.shutdown_grace)
    print(banner(settings.model_name, args, engine_args), file=sys.stderr, flush=True)
    try:
        server.run()
    except SystemExit as exit:  # uvicorn's own exit when the port was taken after check_address
        if exit.code == 3:
            raise BusyPort(f"port {args.port} on {args.host} is in use: give another --port") from None
        raise
    if server.started is False:
        raise OSError(f"could not serve on {args.host}:{args.port}")
    log.info("stopped after %d HTTP requests", server.server_state.total_requests)
    return 0


def banner(model_name: str, args, engine_args: EngineArgs) -> str:
    """What serves where, and how it drafts."""
    draft, k = engine_args.draft, engine_args.num_draft_tokens
    how = "" if draft == "none" else f"K {'adaptive, at most' if engine_args.adaptive else 'fixed'} {k}, "
    return (f"serving {model_name} on http://{args.host}:{args.port} (draft: {describe_draft(draft)}, {how}batch "
            f"{engine_args.max_batch_size}, queue {args.max_queued})")


def setup_logging(quiet_access: bool) -> None:
    """The server's lines (access log, shutdown, engine failures) on stderr, as uvicorn's."""
    serve_log = logging.getLogger("speculative.serve")
    serve_log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    serve_log.addHandler(handler)
    serve_log.propagate = False  # --verbose's root handler would print each line twice
    if quiet_access:
        logging.getLogger("speculative.serve.access").setLevel(logging.WARNING)


def _server_class():
    import uvicorn

    class Graceful(uvicorn.Server):
        """uvicorn's server, with SIGTERM as a drain (see the module docstring) and exit status 0
        (uvicorn re-raises the signal after shutting down, which would kill the process)."""

        def __init__(self, config, on_exit, grace: float):
            super().__init__(config)
            self.on_exit, self.grace = on_exit, grace
            self.signalled_at = None

        def handle_exit(self, sig, frame) -> None:
            if self.signalled_at is None:
                self.signalled_at = time.monotonic()
                log.info("shutting down (%s): new requests are refused, running ones get %g s to finish",
                         signal.Signals(sig).name, self.grace)
                self.on_exit()
            super().handle_exit(sig, frame)

        def capture_signals(self):
            import contextlib

            @contextlib.contextmanager
            def captured():
                handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in handlers.items():
                        signal.signal(sig, handler)
            return captured()

    return Graceful


def GracefulServer(config, on_exit, grace: float = 0.0):  # noqa: N802 (made on first use: uvicorn is an extra)
    return _server_class()(config, on_exit, grace)
