"""Prometheus metrics of one server (names prefixed `flashllm:`), on a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flashllm.outputs import RequestOutput
from flashllm.serving.async_engine import EngineStats
from flashllm.serving.connection import ConnectionLimits

disable_created_metrics()  # the *_created series only add noise to every scrape
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONNECTION_CLOSE_REASONS = ("header_timeout", "body_timeout", "idle_timeout", "over_capacity", "bad_framing")


class _StallCollector(Collector):
    """The engine watchdog: seconds without a step while requests are in flight, and stalls seen."""

    def __init__(self, model_name: str, read: Callable[[], tuple[float, int]]) -> None:
        self._model_name = model_name
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        seconds, stalls = self._read()
        since = GaugeMetricFamily("flashllm:engine_seconds_since_step", "seconds the engine loop has gone "
                                  "without a step while requests are in flight (0 when idle)", labels=["model_name"])
        since.add_metric([self._model_name], seconds)
        counted = CounterMetricFamily("flashllm:engine_stalls", "times the engine loop went --engine-stall-warning "
                                      "seconds without a step while requests were in flight", labels=["model_name"])
        counted.add_metric([self._model_name], stalls)
        yield since
        yield counted


class _ConnectionCollector(Collector):
    """Open connections and connections the server closed, by reason, read from the connection layer."""

    def __init__(self, model_name: str, limits: ConnectionLimits) -> None:
        self._model_name = model_name
        self._limits = limits

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        open_now = GaugeMetricFamily("flashllm:connections_open", "open HTTP connections", labels=["model_name"])
        open_now.add_metric([self._model_name], self._limits.open_connections)
        closed = CounterMetricFamily("flashllm:connections_closed", "connections the server closed, by reason",
                                     labels=["model_name", "reason"])
        for reason in CONNECTION_CLOSE_REASONS:
            closed.add_metric([self._model_name, reason], self._limits.closed.get(reason, 0))
        yield open_now
        yield closed


class ServerMetrics:
    """Counters and histograms updated by the API layer; engine gauges read at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 connections: ConnectionLimits | None = None,
                 stall: Callable[[], tuple[float, int]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        if connections is not None:
            self.registry.register(_ConnectionCollector(model_name, connections))
        if stall is not None:
            self.registry.register(_StallCollector(model_name, stall))
        self._stats = stats
        labels = {"model_name": model_name}
        self._labels = labels

        def gauge(name: str, doc: str, read: Callable[[EngineStats], float]) -> None:
            g = Gauge(f"flashllm:{name}", doc, list(labels), registry=self.registry)
            g.labels(**labels).set_function(lambda: read(self._stats()))

        gauge("num_requests_running", "sequences in the running batch", lambda s: s.num_running)
        gauge("num_requests_waiting", "sequences waiting for admission", lambda s: s.num_waiting)
        gauge("kv_blocks_total", "paged KV cache blocks", lambda s: s.num_blocks_total)
        gauge("kv_blocks_free", "free paged KV cache blocks", lambda s: s.num_blocks_free)
        gauge("num_preemptions", "sequences preempted (recomputed later) since start",
              lambda s: s.num_preemptions)
        gauge("spec_decode_num_draft_tokens", "speculative decoding: tokens drafted since start",
              lambda s: s.spec_drafted)
        gauge("spec_decode_num_accepted_tokens", "speculative decoding: drafted tokens the model accepted",
              lambda s: s.spec_accepted)
        gauge("spec_decode_acceptance_rate", "speculative decoding: accepted / drafted tokens since start",
              lambda s: s.spec_accepted / s.spec_drafted if s.spec_drafted else 0.0)
        gauge("spec_decode_mean_accepted_length", "speculative decoding: tokens per verified round, the model's "
              "own token included (1 = no gain)", lambda s: s.spec_emitted / s.spec_rounds if s.spec_rounds else 0.0)
        self.aborted = Counter("flashllm:requests_aborted", "requests aborted, by reason",
                               [*labels, "reason"], registry=self.registry)
        self.rejected = Counter("flashllm:requests_rejected", "requests refused before running, by reason",
                                [*labels, "reason"], registry=self.registry)
        self.finished = Counter("flashllm:requests_finished", "requests finished, by finish reason",
                                [*labels, "finish_reason"], registry=self.registry)
        self.client_disconnects = Counter("flashllm:client_disconnects",
                                          "clients that went away before their request body arrived", list(labels),
                                          registry=self.registry)
        self.client_disconnects.labels(**labels)  # scraped as 0 from the start, not absent
        self.prompt_tokens = Counter("flashllm:prompt_tokens", "prompt tokens processed", list(labels),
                                     registry=self.registry)
        self.generation_tokens = Counter("flashllm:generation_tokens", "tokens generated", list(labels),
                                         registry=self.registry)
        self.ttft = Histogram("flashllm:time_to_first_token_seconds", "arrival to first token", list(labels),
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("flashllm:inter_token_latency_seconds", "time between streamed outputs",
                             list(labels), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("flashllm:e2e_request_latency_seconds", "arrival to last token", list(labels),
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(**self._labels, reason=reason).inc()

    def abort(self, reason: str) -> None:
        self.aborted.labels(**self._labels, reason=reason).inc()

    def client_disconnect(self) -> None:
        self.client_disconnects.labels(**self._labels).inc()

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(**self._labels).observe(seconds)

    def finish(self, output: RequestOutput) -> None:
        """Record a finished request: tokens, reasons and latencies."""
        self.prompt_tokens.labels(**self._labels).inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.generation_tokens.labels(**self._labels).inc(len(completion.token_ids))
            self.finished.labels(**self._labels, finish_reason=completion.finish_reason or "unknown").inc()
        if output.metrics.time_to_first_token is not None:
            self.ttft.labels(**self._labels).observe(output.metrics.time_to_first_token)
        if output.metrics.latency is not None:
            self.e2e.labels(**self._labels).observe(output.metrics.latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
