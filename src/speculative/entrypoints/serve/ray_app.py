"""`speculative serve --ray`: the same OpenAI-compatible app as Ray Serve replicas.

Three deployments, one application (`build_app`, the builder a Serve config names):
- EngineReplica: one engine per replica (models loaded from the EngineArgs, as `batch
  --ray`'s actors do), its EngineLoop, answering `Call`s as streams of Events. Replicas
  are `--replicas N`, or autoscaled on ongoing requests (`--replicas auto`). Routed by
  `ray_router.PrefixRouter`, so a conversation's turns meet the caches that hold it (or by
  Serve's default router, the less busy of two at random: `--router serve`, for comparison).
- Ingress: the FastAPI app of `app.create_app` behind `@serve.ingress`, over a RemoteLoop
  (ray_remote): every route, check, error and header is the plain server's. It holds no
  model: the tokenizer and the limits come from an engine replica. Two hops, not one,
  because Serve routes HTTP requests before their body is read, and the body holds the
  prompt that prefix routing needs (ray.serve.llm splits its ingress from its engines too).
- MetricsBoard: the replicas' latest Prometheus texts, which the ingress's /metrics merges.

The command starts Serve on --host/--port (a local Ray cluster when no address is given),
blocks until SIGINT or SIGTERM, then deletes the application, whose replicas first finish
what they hold (up to --shutdown-grace seconds), and shuts Serve down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict, replace

from ray import serve

from ...core.grammar import Grammar
from ..engine_args import EngineArgs
from .app import Settings, create_app
from .engine_loop import EngineLoop, Job
from .metrics import Metrics
from .ray_remote import PUSH_SECONDS, Call, RemoteLoop
from .ray_router import PrefixRouter

log = logging.getLogger("speculative.serve")

APP_NAME = "speculative"
IMPORT_PATH = "speculative.entrypoints.serve.ray_app:build_app"
STALE_SECONDS = 60.0  # a replica silent this long (dead, scaled down) leaves /metrics
# Server options (the plain server's) and their defaults when a config leaves them out.
SERVER = {"model_name": "default", "api_key": None, "max_body_bytes": 1 << 20, "max_queued": None,
          "chat_template": None, "shutdown_grace": 30.0, "access_log": True}
# Scale: --replicas (an integer, or "auto" between min and max), CPUs (torch threads) per replica,
# and Serve autoscaling fields that replace ours (tests shorten the delays).
SCALE = {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "replica_cpus": 1, "autoscaling": {}, "router": "prefix"}
ROUTERS = ("prefix", "serve")  # ours (ray_router), or Serve's default (power of two choices)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class MetricsBoard:
    """Each replica's latest exposition, by replica id."""

    def __init__(self):
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.monotonic())

    def collect(self) -> dict[str, str]:
        now = time.monotonic()
        self.texts = {r: (text, at) for r, (text, at) in self.texts.items() if now - at < STALE_SECONDS}
        return {r: text for r, (text, _) in self.texts.items()}


@serve.deployment(health_check_period_s=2, graceful_shutdown_wait_loop_s=0.5)
class EngineReplica:
    """One engine and its loop; `generate` streams a Call's Events."""

    async def __init__(self, engine_args: dict, server: dict, board):
        from .command import check_template, warm_up

        args = EngineArgs(**engine_args).validate()
        built = await asyncio.to_thread(args.build)
        engine, self.tokenizer, self.context = built.engine(), built.tokenizer, built.context
        if server["chat_template"]:
            self.tokenizer.chat_template = server["chat_template"]
            check_template("--chat-template", "(the template given)", self.tokenizer)
        await asyncio.to_thread(warm_up, engine, self.tokenizer)
        self.vocab_size = engine.target.vocab_size
        self.loop = EngineLoop(engine, self.tokenizer.decode, Metrics(), server["max_queued"])
        self.loop.start()
        self.grammars: dict[tuple[str, str], Grammar] = {}
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self.pusher = asyncio.get_running_loop().create_task(self.push())

    def describe(self) -> dict:
        """What the ingress needs to check requests as this replica would."""
        return {"tokenizer": self.tokenizer, "context": self.context, "vocab_size": self.vocab_size,
                "eos_token_ids": tuple(self.tokenizer.eos_token_ids), "capacity": self.loop.capacity}

    async def generate(self, call: Call):
        events: asyncio.Queue = asyncio.Queue()
        running = asyncio.get_running_loop()
        params = [p if spec is None else replace(p, grammar=await self.grammar(spec))
                  for p, spec in zip(call.params, call.grammars)]
        self.loop.submit(Job(call.request_ids, call.prompts, params, call.stops,
                             lambda e: running.call_soon_threadsafe(events.put_nowait, e), self.loop.clock()))
        left, admitted = set(range(len(call.prompts))), False
        try:
            while left:
                event = await events.get()
                yield replace(event, replica=self.replica) if event.finish_reason is not None else event
                if event.kind == "error" and not admitted:
                    left.clear()
                admitted = admitted or event.kind == "admitted"
                if event.finish_reason is not None or event.kind == "error":
                    left.discard(event.index)
        finally:
            if left:  # cancelled: the client went away
                self.loop.abort(call.request_ids)

    async def grammar(self, spec: tuple[str, str]) -> Grammar:
        if spec not in self.grammars:
            def build() -> Grammar:
                return Grammar(*spec, self.tokenizer.grammar_tokenizer(self.vocab_size or len(self.tokenizer)))
            self.grammars[spec] = await asyncio.to_thread(build)
        return self.grammars[spec]

    async def push(self) -> None:
        """This replica's metrics to the board, every PUSH_SECONDS."""
        while True:
            try:
                await self.board.put.remote(self.replica, self.loop.metrics.exposition().decode())
            except Exception as error:  # the board restarting: the next push will do
                log.warning("metrics push failed: %s", error)
            await asyncio.sleep(PUSH_SECONDS)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine has stopped."""
        if not self.loop.alive:
            raise RuntimeError(self.loop.failed or "the engine loop has stopped")

    def __del__(self):
        self.loop.drain(0.0)
        self.loop.stop(timeout=5.0)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress()
class Ingress:
    """The FastAPI app over the engine replicas."""

    async def __init__(self, engine, board, server: dict):
        from .command import setup_logging

        setup_logging(not server["access_log"])
        info = await engine.describe.remote()
        self.loop = RemoteLoop(engine, board, info["capacity"])
        self.tokenizer = info["tokenizer"]
        self.settings = Settings(server["model_name"], info["context"], server["api_key"], server["max_body_bytes"],
                                 info["eos_token_ids"], vocab_size=info["vocab_size"])

    def __serve_build_asgi_app__(self):
        return create_app(self.loop, self.tokenizer, self.settings)


def build_app(args: dict):
    """Serve's application builder: {"engine": EngineArgs fields, "server": SERVER options,
    "scale": SCALE options} to the application (what `serve deploy` and a RayService run)."""
    unknown = set(args) - {"engine", "server", "scale"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}: allowed engine, server, scale")
    given = EngineArgs(**args.get("engine", {}))
    engine_args = given.validate()
    server = {**SERVER, **args.get("server", {})}
    if server["max_queued"] is None:
        server["max_queued"] = 8 * engine_args.max_batch_size  # command.QUEUED_PER_ROW, as the plain server
    scale = {**SCALE, **args.get("scale", {})}
    if scale["router"] not in ROUTERS:
        raise ValueError(f"router {scale['router']!r}: allowed {', '.join(ROUTERS)}")
    given.threads = given.threads or scale["replica_cpus"]  # torch threads: the CPUs reserved
    board = MetricsBoard.bind()
    engine = EngineReplica.options(**engine_options(engine_args, server, scale)).bind(plain(given), server, board)
    return Ingress.options(graceful_shutdown_timeout_s=server["shutdown_grace"] + 5).bind(engine, board, server)


def plain(engine_args: EngineArgs) -> dict:
    """EngineArgs as plain names and numbers (a YAML file's args). Give it the options as given,
    not validate()'s copy: what validate() fills in (K, n-gram sizes) it refuses with some
    drafts (--draft none), so a validated copy would not validate again on the replicas."""
    return {k: v for k, v in asdict(engine_args).items() if k != "checked"}


def engine_options(engine_args: EngineArgs, server: dict, scale: dict) -> dict:
    """The engine deployment's replicas, CPUs, limits and router.

    Autoscaling targets max_batch_size ongoing requests per replica: a replica with a full
    batch is as busy as it should be (more only queue behind the batch), so requests past
    that ask for another replica. Each replica takes max_batch_size plus max_queued calls
    (its own capacity); past that, each ingress queues max_queued more before a 429."""
    options = {"ray_actor_options": {"num_cpus": scale["replica_cpus"]},
               "max_ongoing_requests": engine_args.max_batch_size + server["max_queued"],
               "max_queued_requests": max(1, server["max_queued"]),
               "graceful_shutdown_timeout_s": server["shutdown_grace"]}
    if scale.get("router", "prefix") == "prefix":  # otherwise Serve's default router
        options["request_router_config"] = {"request_router_class": PrefixRouter,
                                            "request_router_kwargs": {"imbalance": engine_args.max_batch_size}}
    if scale["replicas"] == "auto":
        options["autoscaling_config"] = {"min_replicas": scale["min_replicas"], "max_replicas": scale["max_replicas"],
                                         "target_ongoing_requests": engine_args.max_batch_size,
                                         **scale["autoscaling"]}
    else:
        options["num_replicas"] = int(scale["replicas"])
    return options


def app_args(args) -> dict:
    """The builder's args from the command line (options checked)."""
    from .command import read_template

    given = EngineArgs.from_args(args)
    given.validate()
    engine = plain(given)
    template = None if args.chat_template is None else read_template("--chat-template", args.chat_template)
    server = {"model_name": args.served_model_name or args.target, "api_key": args.api_key,
              "max_body_bytes": args.max_body_bytes, "max_queued": args.max_queued, "chat_template": template,
              "shutdown_grace": args.shutdown_grace, "access_log": not args.no_access_log}
    scale = {"replicas": args.replicas, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
             "replica_cpus": args.replica_cpus, "router": args.router}
    if args.replicas == "auto" and not 1 <= args.min_replicas <= args.max_replicas:
        raise ValueError(f"--min-replicas {args.min_replicas} and --max-replicas {args.max_replicas}: allowed "
                         "1 <= --min-replicas <= --max-replicas")
    return {"engine": engine, "server": server, "scale": scale}


def serve_config(args, built: dict) -> dict:
    """The Serve config (`serve deploy`, a RayService's serveConfigV2) of these options."""
    options = engine_options(EngineArgs(**built["engine"]).validate(), {**SERVER, **built["server"],
                             "max_queued": built["server"]["max_queued"] or 0}, {**SCALE, **built["scale"]})
    shown = {k: options[k] for k in ("num_replicas", "autoscaling_config", "ray_actor_options") if k in options}
    return {"proxy_location": "EveryNode", "http_options": {"host": args.host, "port": args.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": built,
                              "deployments": [{"name": "EngineReplica", **shown}]}]}


def run_ray(args) -> int:
    """The command: print the config, or deploy and serve until a signal."""
    import yaml

    built = app_args(args)
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(serve_config(args, built), sort_keys=False))
        return 0
    import ray

    from ..batch_ray import connect
    from .command import check_address

    check_address(args.host, args.port)
    joined = connect(None if args.ray == "local" else args.ray)
    stop, handlers = threading.Event(), {}
    try:  # ours replace Ray's (which abort the process), from before the app starts
        handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(built), name=APP_NAME, route_prefix="/")
        print(banner(built, args), file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        print(f"shutting down: replicas finish their requests (at most {args.shutdown_grace:g} s)", file=sys.stderr,
              flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if joined:
            ray.shutdown()
    return 0


def banner(built: dict, args) -> str:
    scale = built["scale"]
    size = (f"{scale['min_replicas']}..{scale['max_replicas']} replicas (autoscaled)" if scale["replicas"] == "auto"
            else f"{scale['replicas']} replicas")
    return (f"serving {built['server']['model_name']} on http://{args.host}:{args.port} through Ray Serve: {size} "
            f"of {scale['replica_cpus']} CPU each, routed by {scale['router']}")
