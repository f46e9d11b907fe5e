"""Prometheus metrics of the server (``GET /metrics``, text exposition format), on a registry of
its own. Gauges are read when scraped: sequences running and waiting in the engine, the fraction
of KV blocks held. Counters and histograms are updated as each request ends: prompt and
generation tokens, time to first token, time per output token, queue time, end-to-end latency,
finished requests by finish reason, refused or failed requests by HTTP status."""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


PREFIX = "qwen_serve_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, loop):
        r = self.registry = CollectorRegistry()
        Gauge(PREFIX + "num_requests_running", "Sequences admitted to the engine (holding KV blocks).",
              registry=r).set_function(lambda: loop.counts()["running"])
        Gauge(PREFIX + "num_requests_waiting", "Sequences queued for the engine (or preempted).",
              registry=r).set_function(lambda: loop.counts()["waiting"])
        Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of the KV cache blocks held by sequences (0 to 1).",
              registry=r).set_function(lambda: loop.kv_usage)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests served.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token, per request.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time between a choice's tokens after its first.", buckets=TPOT_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to the engine's first step on it.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter(PREFIX + "request_success", "Choices finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter(PREFIX + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
