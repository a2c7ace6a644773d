"""`speculative serve --ray` on a real local Ray cluster started here, through the official
`openai` client over 127.0.0.1.

Quick: the Serve config that --print-config writes (it parses, Serve's schema takes it, its
import path builds the application), option errors, and the pure parts (prefix keys, the
metrics merge). Slow (a Ray cluster takes tens of seconds to start on 2 cores): outputs
through 2 replicas equal the single-process server's; both replicas serve under load;
prefix routing; the command's drain on SIGTERM; autoscaling 1 -> 2 -> 1; a replica killed
mid-load. Every wait has a deadline.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")
yaml = pytest.importorskip("yaml")

from speculative.entrypoints.serve.ray_remote import merge  # noqa: E402
from speculative.entrypoints.serve.ray_router import BLOCK_TOKENS, prefix_keys  # noqa: E402
from tests.serving import TEMPLATE, TIMEOUT, Server, free_port  # noqa: E402

CLI = [sys.executable, "-m", "speculative.entrypoints.cli", "serve"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SYSTEM = ("You are a careful Python reviewer. Answer with code only, in the style of the standard library, with "
          "docstrings, type hints and no external packages. Keep every function short.")
PROMPTS = ["def add(a, b):", "import os\nimport sys\n\n\ndef main(argv):", "for i in range(10):\n    if i % 2 == 0:",
           "class Stack:\n    def __init__(self):\n        self.items = []", "def fib(n):\n    if n < 2:"]


# --- quick -------------------------------------------------------------------------------
def test_print_config_round_trips(tmp_path):
    """The YAML parses, Serve's deploy schema takes it, its import path is our builder, and
    the builder makes an application with the printed autoscaling."""
    from ray.serve.schema import ServeDeploySchema

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    out = subprocess.run(CLI + ["--ray", "--replicas", "auto", "--max-replicas", "4", "--max-batch-size", "4",
                                "--chat-template", str(template), "--port", "9123", "--print-config"],
                         capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    ServeDeploySchema.model_validate(config)  # what `serve deploy` checks
    assert config["http_options"] == {"host": "127.0.0.1", "port": 9123}
    (application,) = config["applications"]
    module, _, name = application["import_path"].partition(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    assert application["args"]["server"]["chat_template"] == TEMPLATE
    (engine,) = application["deployments"]
    assert engine["name"] == "EngineReplica"
    assert engine["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4}
    built = builder(application["args"])
    assert isinstance(built, serve.Application)
    options = built._bound_deployment.init_args[0]._bound_deployment._deployment_config  # the engine deployment
    assert options.autoscaling_config.max_replicas == 4 and options.max_ongoing_requests == 4 + 32
    with pytest.raises(ValueError, match="unknown application args"):
        builder({"engines": {}})


def test_router_switch():
    """--router serve leaves Serve's default router; prefix (the default) is ours."""
    from speculative.entrypoints.serve.ray_app import build_app
    from speculative.entrypoints.serve.ray_router import PrefixRouter

    def router(scale: dict):
        config = build_app({"scale": scale})._bound_deployment.init_args[0]._bound_deployment._deployment_config
        return config.request_router_config.request_router_class

    assert router({}).endswith(PrefixRouter.__name__)
    assert not router({"router": "serve"}).endswith(PrefixRouter.__name__)
    with pytest.raises(ValueError, match="allowed prefix, serve"):
        build_app({"scale": {"router": "random"}})
    out = subprocess.run(CLI + ["--ray", "--router", "serve", "--print-config"], capture_output=True, text=True,
                         env=ENV, timeout=TIMEOUT)
    assert out.returncode == 0 and yaml.safe_load(out.stdout)["applications"][0]["args"]["scale"]["router"] == "serve"


def test_plain_decoding_config():
    """--draft none's args survive the trip to the replicas (validated again there)."""
    out = subprocess.run(CLI + ["--ray", "--draft", "none", "--print-config"], capture_output=True, text=True,
                         env=ENV, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["applications"][0]["args"]["engine"]["draft"] == "none"


def test_options_that_need_ray_are_refused():
    out = subprocess.run(CLI + ["--replicas", "2"], capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
    assert out.returncode == 2 and "--replicas apply with --ray" in out.stderr
    out = subprocess.run(CLI + ["--router", "serve"], capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
    assert out.returncode == 2 and "--router apply with --ray" in out.stderr
    out = subprocess.run(CLI + ["--ray", "--replicas", "many", "--print-config"], capture_output=True, text=True,
                         env=ENV, timeout=TIMEOUT)
    assert out.returncode == 2 and "'auto'" in out.stderr


def test_prefix_keys_follow_shared_blocks():
    turn1 = list(range(100, 150))
    turn2 = turn1 + [7, 8, 9] * 10
    assert len(prefix_keys(turn1)) == 50 // BLOCK_TOKENS
    assert prefix_keys(turn2)[:3] == prefix_keys(turn1)
    assert prefix_keys([1] + turn1[1:])[0] != prefix_keys(turn1)[0]  # the chain: one token changes every key
    assert prefix_keys(turn1[:BLOCK_TOKENS - 1]) == []


def test_metrics_merge_labels_each_replica():
    one = "# HELP x_total Things\n# TYPE x_total counter\nx_total{k=\"a\"} 2.0\n"
    text = merge({"r1": one, "r2": one.replace("2.0", "5.0")}).decode()
    assert 'x_total{k="a",replica="r1"} 2.0' in text and 'x_total{k="a",replica="r2"} 5.0' in text


# --- slow: a cluster -----------------------------------------------------------------------
def ray_pids(name: str) -> list[int]:
    """Processes of this module's cluster whose command line holds `name`."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if name in " ".join(process.cmdline()):
                found.append(process.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_command_serves_and_drains_on_sigterm():
    """`serve --ray` starts its own cluster, serves, and on SIGTERM lets a running stream
    finish before it exits 0, leaving no Ray process behind."""
    port = free_port()
    log = open(os.devnull, "w")
    process = subprocess.Popen(CLI + ["--ray", "--port", str(port), "--shutdown-grace", "60"], stdout=log,
                               stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                               timeout=TIMEOUT)
        stream = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"min_tokens": 200})
        first = next(iter(stream))
        process.send_signal(signal.SIGTERM)
        chunks = [first] + list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    time.sleep(2)
    assert not [p for p in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])]


def wait_healthy(url: str, process=None, deadline: float = 300.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert process is None or process.poll() is None, "the command exited"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {deadline} s")


@pytest.fixture(scope="module")
def cluster():
    """A local cluster (4 logical CPUs on this 2-core machine: 2 replicas, and an autoscaled
    app of its own), Serve on a free port, and the application with 2 replicas on "/"."""
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    plain = Server(template=True)
    try:
        from speculative.entrypoints.serve.ray_app import build_app

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"server": {"chat_template": TEMPLATE}, "scale": {"replicas": 2}}), name="speculative",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", plain.wait_healthy()
    finally:
        plain.stop()
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def answer(url: str, kind: str, stream: bool, **kwargs):
    """(text, finish_reason, usage) of one request, streamed or whole."""
    api = client(url).chat.completions if kind == "chat" else client(url).completions
    if not stream:
        r = api.create(model="default", **kwargs)
        choice = r.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason, r.usage.model_dump()
    text, finish, usage = "", None, None
    for chunk in api.create(model="default", stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta.content if kind == "chat" else chunk.choices[0].text
            text, finish = text + (delta or ""), chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage.model_dump()
    return text, finish, usage


def replica_counts(url: str, name: str = "speculative_requests_total") -> dict[str, float]:
    """`name` summed over its other labels, by replica."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def wait_counts(url: str, total: float, deadline: float = 60.0) -> dict[str, float]:
    """Per-replica finished requests once they add up to `total` (replicas push every 0.5 s)."""
    end = time.monotonic() + deadline
    while True:
        counts = replica_counts(url)
        if sum(counts.values()) >= total or time.monotonic() > end:
            return counts
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_two_replicas_answer_as_one_process(cluster, kind):
    """Greedy and seeded sampled requests, streamed and whole: the same text, finish reason
    and usage through Ray as from the single-process server."""
    url, plain = cluster
    for i, prompt in enumerate(PROMPTS[:3]):
        body = ({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]}
                if kind == "chat" else {"prompt": prompt})
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1234 + i}
        for stream in (False, True):
            args = {**body, **sampling, "max_tokens": 40}
            assert answer(url, kind, stream, **args) == answer(plain.url, kind, stream, **args), (prompt, stream)


@pytest.mark.slow
def test_both_replicas_serve_under_load(cluster):
    url, _ = cluster
    before = wait_counts(url, 0)
    prompts = [f"{p}\n# variant {i}" for i in range(4) for p in PROMPTS]  # 20 requests, 8 at a time
    with futures.ThreadPoolExecutor(8) as pool:
        finishes = list(pool.map(lambda p: answer(url, "completion", False, prompt=p, max_tokens=24,
                                                  temperature=0)[1], prompts))
    assert all(f in ("stop", "length") for f in finishes)
    after = wait_counts(url, sum(before.values()) + len(prompts))
    served = {r: after[r] - before.get(r, 0.0) for r in after}
    assert sum(served.values()) == len(prompts)
    assert len([r for r, n in served.items() if n > 0]) == 2, served
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    assert text.count("speculative_spec_decode_num_draft_tokens_total{replica=") == 2


@pytest.mark.slow
def test_turns_of_a_conversation_stay_on_one_replica(cluster):
    """Two conversations of 5 turns each, turns one after another: each conversation's turns
    all land on one replica (by Serve's default router, 5 turns on one replica of 2 has
    probability 1/16)."""
    url, _ = cluster
    for conversation in range(2):
        before = wait_counts(url, 0)
        messages, replicas = [{"role": "system", "content": f"{SYSTEM} Conversation {conversation}."}], set()
        for turn in range(5):
            messages.append({"role": "user", "content": PROMPTS[turn]})
            reply = client(url).chat.completions.create(model="default", messages=messages, max_tokens=12,
                                                        temperature=0)
            replicas.add(reply.model_extra["speculative"]["replica"])  # the reply names its replica
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        after = wait_counts(url, sum(before.values()) + 5)
        served = {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}
        assert list(served.values()) == [5.0] and list(served) == list(replicas), (served, replicas)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_autoscaling_one_to_two_to_one(cluster):
    """From 1 replica, a burst above the target (2 ongoing per replica) brings a second one;
    idle, it goes back to 1. Short delays: 1 s up, 4 s down. Handles push their load every
    0.5 s: at Serve's 10 s, each push holds only the last look-back (2 s), and on a loaded
    machine the burst was missed (all 1s for 240 s, once in a full slow run)."""
    from speculative.entrypoints.serve.ray_app import build_app

    url, _ = cluster
    quick = {"upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 2, "metrics_interval_s": 0.5}
    serve.run(build_app({"engine": {"max_batch_size": 2, "draft": "ngram"},
                         "scale": {"replicas": "auto", "min_replicas": 1, "max_replicas": 2, "autoscaling": quick}}),
              name="auto", route_prefix="/auto")
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            states = serve.status().applications["auto"].deployments["EngineReplica"].replica_states
            seen.append(states.get("RUNNING", 0))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert wait_for(lambda: seen and seen[-1] == 1, 60)
        with futures.ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(answer, f"{url}/auto", "completion", False, prompt=p, max_tokens=150,
                                 temperature=0, extra_body={"min_tokens": 150}) for p in PROMPTS * 2]
            assert wait_for(lambda: 2 in seen, 240), seen
            assert all(f.result(TIMEOUT)[1] == "length" for f in burst)
        assert wait_for(lambda: seen[-1] == 1, 120), seen[-10:]
    finally:
        stop.set()
        watcher.join(5)
        serve.delete("auto")


def wait_for(condition, deadline: float) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.25)
    return False


@pytest.mark.slow
def test_a_replica_killed_mid_load_loses_no_request(cluster):
    """SIGKILL to one engine replica while 16 requests run (8 streamed): each ends with an
    answer or a clean error (HTTP 5xx with a JSON body, or the stream's error), the other
    replica keeps answering, and Serve brings the replica back. Runs last: it breaks one."""
    url, _ = cluster
    pids = ray_pids("EngineReplica")
    assert len([p for p in pids if "ServeReplica:speculative:" in " ".join(psutil.Process(p).cmdline())]) == 2

    def one(i: int) -> str:
        try:
            text, finish, _ = answer(url, "completion", i % 2 == 1, prompt=f"{PROMPTS[i % 5]}\n# {i}",
                                     max_tokens=120, temperature=0, extra_body={"min_tokens": 120})
            return finish
        except openai.APIStatusError as error:
            assert error.status_code >= 500 and "message" in error.response.json()["error"], error
            return "error"
        except openai.APIError as error:  # an error chunk in a stream: the client raises with its message
            assert error.message, error
            return "error"

    with futures.ThreadPoolExecutor(16) as pool:
        running = [pool.submit(one, i) for i in range(16)]
        time.sleep(3)
        assert not all(f.done() for f in running), "the load was over before the kill"
        victim = next(p for p in ray_pids("ServeReplica:speculative:EngineReplica"))
        os.kill(victim, signal.SIGKILL)
        endings = [f.result(TIMEOUT) for f in running]
    assert set(endings) <= {"length", "error"} and endings.count("length") >= 8, endings
    after = [answer(url, "completion", False, prompt=p, max_tokens=8, temperature=0)[1] for p in PROMPTS]
    assert after == ["length"] * 5
    assert wait_for(lambda: len(ray_pids("ServeReplica:speculative:EngineReplica")) == 2
                    and serve.status().applications["speculative"].deployments["EngineReplica"]
                    .replica_states.get("RUNNING", 0) == 2, 240)
