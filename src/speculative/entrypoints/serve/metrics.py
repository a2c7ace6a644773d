"""Prometheus metrics of the server, named after vLLM's under our own prefix.

Counters: requests (by finish reason), requests refused because the queue was full, prompt
and generated tokens (the tokens clients were given), and speculative decoding: drafts
(row-steps that drafted), draft tokens, accepted tokens, accepted tokens per position.
Gauges: running and waiting requests. Histograms: time to first token, inter-token latency
(between successive outputs of a request: one per engine step, which may carry several
tokens), end-to-end latency. Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ...core.stats import DecodeStats

PREFIX = "speculative"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        name = lambda n: f"{PREFIX}_{n}"  # noqa: E731
        self.requests = Counter(name("requests"), "Finished requests, by finish reason", ["finish_reason"],
                                registry=r)
        self.refused = Counter(name("requests_refused"), "Requests refused with 429 because the queue was full "
                               "(--max-queued)", registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Generated tokens given to clients", registry=r)
        self.drafts = Counter(name("spec_decode_num_drafts"), "Row-steps that drafted at least one token",
                              registry=r)
        self.draft_tokens = Counter(name("spec_decode_num_draft_tokens"), "Drafted tokens", registry=r)
        self.accepted_tokens = Counter(name("spec_decode_num_accepted_tokens"), "Drafted tokens the target kept",
                                       registry=r)
        self.accepted_per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"),
                                        "Drafted tokens kept, by draft position (0-based)", ["position"],
                                        registry=r)
        self.running = Gauge(name("num_requests_running"), "Requests in the running batch", registry=r)
        self.waiting = Gauge(name("num_requests_waiting"), "Requests waiting for a row", registry=r)
        self.ttft = Histogram(name("time_to_first_token_seconds"), "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram(name("inter_token_latency_seconds"), "Between successive outputs of a request",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(name("e2e_request_latency_seconds"), "Arrival to the last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        self._seen = DecodeStats()

    def engine_step(self, totals: DecodeStats, count: bool = True) -> None:
        """Count what the engine drafted and kept since the last call (`totals`: its running
        sums); `count=False` only takes note of them (what a warm-up drafted)."""
        seen = self._seen if count else totals
        self.draft_tokens.inc(totals.drafted - seen.drafted)
        self.accepted_tokens.inc(totals.accepted - seen.accepted)
        self.drafts.inc((totals.drafted_at[:1] or [0])[0] - (seen.drafted_at[:1] or [0])[0])
        for i, count in enumerate(totals.accepted_at):
            before = seen.accepted_at[i] if i < len(seen.accepted_at) else 0
            if count > before:
                self.accepted_per_pos.labels(str(i)).inc(count - before)
        self._seen = DecodeStats(drafted=totals.drafted, accepted=totals.accepted,
                                 drafted_at=list(totals.drafted_at), accepted_at=list(totals.accepted_at))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
