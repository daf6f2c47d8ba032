"""`GET /metrics`: what operators scrape, in Prometheus' text format, named as vLLM names them ("autotp:").

Counted per prompt row (a request with n prompts or n choices is n rows), as vLLM counts sequences:

- autotp:num_requests_running, autotp:num_requests_waiting (gauges, read at scrape time), and
  autotp:kv_cache_usage_perc (the slots rows hold over the KV budget, 0 to 1: cached blocks no row holds
  count as free, as vLLM counts them);
- autotp:time_to_first_token_seconds, autotp:inter_token_latency_seconds,
  autotp:e2e_request_latency_seconds (histograms, vLLM's buckets), from the request's arrival;
- autotp:prompt_tokens_total, autotp:generation_tokens_total (counters, finished rows);
- autotp:prefix_cache_queries_total, autotp:prefix_cache_hits_total (counters): prompt tokens looked up
  in the paged engine's prefix cache as rows are admitted, and those found there (not computed again);
- autotp:spec_decode_num_draft_tokens_total, autotp:spec_decode_num_accepted_tokens_total (counters):
  prompt-lookup draft tokens verified (`--speculate`), and those the rows' samplers drew too;
- autotp:request_success_total{finished_reason="stop"|"length"} (rows), and
  autotp:request_errors_total{status} (HTTP requests answered 4xx/5xx, 499 for a client that left).

Every family has samples from start-up: the labelled counters start at 0 for each finished_reason and for the
statuses autotp answers with. A router that merges its replicas' scrapes (sglang-router's /engine_metrics) refuses
a family whose label names differ between replicas, as they do between one with samples and one without.

The engine hands over data (engine/stats.py): each step's StepStats, recorded here from its thread, and its Load,
read at scrape time; the HTTP side counts answers from the event loop. prometheus_client is thread-safe. Each server
has a registry of its own (not the process-global one).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from autotp.serve.engine.stats import Load, StepStats

PREFIX = "autotp:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length")  # engine/output.py's
# what autotp answers errors with: OpenAI's and the guard's 4xx, TGI's 422 and 424, a client that left (499), a
# failed generation (500), /infill on a model without FIM tokens (501), shutting down (503); other statuses (405)
# get their sample when they first happen
ERROR_STATUSES = (400, 401, 404, 413, 415, 422, 424, 429, 499, 500, 501, 503)


class Metrics:
    """load: the engine's Load now (engine/loop.Engine.load), read at each scrape."""

    def __init__(self, load: Callable[[], Load]):
        self.registry = r = CollectorRegistry()
        Gauge(f"{PREFIX}num_requests_running", "Rows decoding or being prefilled.",
              registry=r).set_function(lambda: load().running)
        Gauge(f"{PREFIX}num_requests_waiting", "Rows waiting for room.",
              registry=r).set_function(lambda: load().waiting)
        Gauge(f"{PREFIX}kv_cache_usage_perc", "Used KV cache slots over the KV budget (1 = full).",
              registry=r).set_function(lambda: (lambda now: now.kv_used / now.kv_tokens)(load()))
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "From arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between two generated tokens of a row.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "From arrival to the row's last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished rows.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens of finished rows.",
                                         registry=r)
        self.prefix_queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", registry=r)
        self.prefix_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.drafted = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Prompt-lookup draft tokens verified.",
                               registry=r)
        self.accepted = Counter(f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens the rows' samplers "
                                "drew too (each one a forward saved).", registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Finished rows, by why they finished.",
                               ["finished_reason"], registry=r)
        self.errors = Counter(f"{PREFIX}request_errors", "HTTP requests answered with an error, by status.",
                              ["status"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        for status in ERROR_STATUSES:
            self.errors.labels(status=str(status))

    def record(self, stats: StepStats) -> None:
        """One engine step's stats (from the engine's thread)."""
        for seconds in stats.first_tokens:
            self.ttft.observe(seconds)
        for seconds in stats.inter_tokens:
            self.itl.observe(seconds)
        for ended in stats.ended:
            self.e2e.observe(ended.seconds)
            self.prompt_tokens.inc(ended.prompt_tokens)
            self.generation_tokens.inc(ended.generation_tokens)
            self.success.labels(finished_reason=ended.reason).inc()
        if stats.prefix_queried:
            self.prefix_queries.inc(stats.prefix_queried)
            self.prefix_hits.inc(stats.prefix_hit)
        if stats.drafted:
            self.drafted.inc(stats.drafted)
            self.accepted.inc(stats.accepted)

    def answered(self, status: int) -> None:
        if status >= 400:
            self.errors.labels(status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
