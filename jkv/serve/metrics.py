"""What the server tells operators: Prometheus metrics, OpenTelemetry traces, JSON log lines.

- Prometheus (`/metrics`): names after vLLM's with the `jkv:` prefix and a `model_name` label,
  so dashboards carry over. The engine's gauges and counters (requests running and waiting, KV
  pool usage, prefix-cache queries and hits, preemptions, pages recycled by reason) are read
  from `Engine.stats()` at scrape time; latencies and token counts are observed per request.
  Buckets are vLLM's (TTFT, inter-token latency, request latency).
- OpenTelemetry: one SERVER span per request, named "{operation} {model}" with the GenAI
  semantic convention's attributes, parented from an incoming W3C `traceparent`, with child
  spans for the response-cache lookup, queueing, prefill and decode. On when the standard
  `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (OTLP over HTTP),
  or when a span exporter is passed (tests pass the SDK's in-memory one); off otherwise.
- Logs: one JSON line per request on the `jkv.serve.requests` logger.

The server's packages (the `serve` extra) load where they are used: `jkv serve --help` and
`import jkv.cli` need none of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time

from jkv.compile_time import programs_built

# vLLM's buckets (v1/metrics): TTFT from arrival, inter-token latency, request latencies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
REQUEST_LOG = logging.getLogger("jkv.serve.requests")


@dataclasses.dataclass
class RequestRecord:
    """One request's life, in `time.monotonic()` seconds, filled as it goes."""

    request_id: str
    operation: str  # "chat" | "text_completion"
    arrival: float
    tenant: str | None = None  # the caches' salt (tenant and cache_salt; logged as a hash)
    tenant_name: str | None = None  # the API key's tenant
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache: str | None = None  # response-cache level that answered
    lookup: tuple[float, float] | None = None  # the response-cache lookup's (start, end)
    scheduled: float | None = None  # a step first ran it
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    pages: int = 0
    preemptions: int = 0
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    trace_id: str | None = None
    error: str | None = None  # error.type when the request failed
    reported: bool = False  # its metrics, spans and log line are out
    itl: list[float] = dataclasses.field(default_factory=list)

    def token(self, now: float, n: int) -> None:
        """`n` new tokens arrived at `now`."""
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.itl.append(now - self.last_token)
        self.last_token = now
        self.completion_tokens += n


class _EngineCollector:
    """The engine's own gauges and counters, read at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        label = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value, extra=()):
            c = CounterMetricFamily(name, doc, labels=label + [k for k, _ in extra])
            c.add_metric([self.model_name] + [v for _, v in extra], value)
            return c

        yield gauge("jkv:num_requests_running", "Requests holding pages.", s["running"])
        yield gauge("jkv:num_requests_waiting", "Requests waiting for pages.", s["waiting"])
        yield gauge("jkv:kv_cache_usage_perc", "Share of the KV pool held (0-1).", s["usage"])
        yield counter("jkv:prefix_cache_queries", "Prefix-cache blocks looked up.",
                      s["prefix_queries"])  # fmt: skip
        yield counter("jkv:prefix_cache_hits", "Prefix-cache blocks found.", s["prefix_hits"])
        yield counter("jkv:num_preemptions", "Requests preempted.", s["preemptions"])
        yield counter("jkv:programs_built", "Programs this process compiled or read back from "
                      "the compilation cache (none while serving after --warmup).",
                      programs_built())  # fmt: skip
        recycled = CounterMetricFamily(
            "jkv:pages_recycled", "Cached pages taken back.", labels=label + ["reason"]
        )
        recycled.add_metric([self.model_name, "lazy"], s["recycled_lazy"])
        recycled.add_metric([self.model_name, "watermark"], s["recycled_watermark"])
        yield recycled


class Observability:
    """The server's metrics registry, tracer and request log."""

    def __init__(self, engine, model_name: str, *, span_exporter=None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        r, label = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist("jkv:time_to_first_token_seconds", "Arrival to first token.",
                         TTFT_BUCKETS)  # fmt: skip
        self.itl = hist("jkv:inter_token_latency_seconds", "Between tokens.", ITL_BUCKETS)
        self.e2e = hist("jkv:e2e_request_latency_seconds", "Arrival to last token.",
                        REQUEST_BUCKETS)  # fmt: skip
        self.queue = hist("jkv:request_queue_time_seconds", "Arrival to first step.",
                          REQUEST_BUCKETS)  # fmt: skip
        self.prefill = hist("jkv:request_prefill_time_seconds", "First step to first token.",
                            REQUEST_BUCKETS)  # fmt: skip
        self.decode = hist("jkv:request_decode_time_seconds", "First token to last.",
                           REQUEST_BUCKETS)  # fmt: skip
        self.prompt_tokens = Counter(
            "jkv:prompt_tokens", "Prompt tokens of served requests.", label, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "jkv:generation_tokens", "Generated tokens.", label, registry=r
        ).labels(model_name)
        self.success = Counter(
            "jkv:request_success", "Finished requests.", label + ["finished_reason"], registry=r
        )
        self.cache_lookups = Counter(
            "jkv:response_cache_lookups", "Response-cache lookups.", label, registry=r
        ).labels(model_name)
        self.cache_hits = Counter(
            "jkv:response_cache_hits", "Response-cache hits.", label + ["level"], registry=r
        )
        self.rejected = Counter(
            "jkv:requests_rejected", "Requests refused.", label + ["reason"], registry=r
        )
        self.aborted = Counter(
            "jkv:requests_aborted", "Requests whose client left.", label, registry=r
        ).labels(model_name)
        self.tracer = _tracer(span_exporter)
        # time.monotonic() -> epoch nanoseconds, for spans timed after the fact
        self._epoch = time.time_ns() - int(time.monotonic() * 1e9)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def ns(self, t: float) -> int:
        return self._epoch + int(t * 1e9)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def lookup(self, level: str | None) -> None:
        self.cache_lookups.inc()
        if level is not None:
            self.cache_hits.labels(self.model_name, level).inc()

    def start_span(self, rec: RequestRecord, headers):
        """The request's SERVER span, parented from the headers' traceparent; None when off."""
        if self.tracer is None:
            return None
        from opentelemetry import propagate, trace

        span = self.tracer.start_span(
            f"{rec.operation} {self.model_name}",
            context=propagate.extract(dict(headers)),
            kind=trace.SpanKind.SERVER,
            start_time=self.ns(rec.arrival),
        )
        rec.trace_id = format(span.get_span_context().trace_id, "032x")
        return span

    def done(self, rec: RequestRecord, span=None) -> None:
        """Records a finished (or failed) request: histograms, counters, spans, the log line."""
        rec.finished = rec.finished or time.monotonic()
        if rec.error is None:
            self.prompt_tokens.inc(rec.prompt_tokens)
            self.generation_tokens.inc(rec.completion_tokens)
            self.success.labels(self.model_name, rec.finish_reason or "unknown").inc()
            if rec.first_token is not None:
                self.ttft.observe(rec.first_token - rec.arrival)
                self.e2e.observe(rec.finished - rec.arrival)
                self.decode.observe(rec.finished - rec.first_token)
            for gap in rec.itl:
                self.itl.observe(gap)
            if rec.scheduled is not None:
                self.queue.observe(max(0.0, rec.scheduled - rec.arrival))
                if rec.first_token is not None:
                    self.prefill.observe(max(0.0, rec.first_token - rec.scheduled))
        if span is not None:
            self._spans(rec, span)
        REQUEST_LOG.info(json.dumps(self.log_fields(rec), separators=(",", ":")))

    def log_fields(self, rec: RequestRecord) -> dict:
        def ms(a, b):
            return None if a is None or b is None else round((b - a) * 1000, 3)

        return {
            "event": "request",
            "request_id": rec.request_id,
            "trace_id": rec.trace_id,
            "model": self.model_name,
            "operation": rec.operation,
            "tenant": _tenant_hash(rec.tenant),
            "api_tenant": rec.tenant_name,
            "prompt_tokens": rec.prompt_tokens,
            "completion_tokens": rec.completion_tokens,
            "cached_tokens": rec.cached_tokens,
            "cache": rec.cache,
            "ttft_ms": ms(rec.arrival, rec.first_token),
            "total_ms": ms(rec.arrival, rec.finished),
            "queue_ms": ms(rec.arrival, rec.scheduled),
            "finish_reason": rec.finish_reason,
            "pages": rec.pages,
            "preemptions": rec.preemptions,
            "error": rec.error,
        }

    def _spans(self, rec: RequestRecord, span) -> None:
        from opentelemetry import trace

        ctx = trace.set_span_in_context(span)

        def child(name, a, b):
            if a is not None and b is not None:
                s = self.tracer.start_span(name, context=ctx, start_time=self.ns(a))
                s.end(end_time=self.ns(max(a, b)))

        if rec.lookup is not None:
            child("response_cache.lookup", *rec.lookup)
        if rec.cache is None and rec.error is None:
            queued_from = rec.lookup[1] if rec.lookup is not None else rec.arrival
            child("queue", queued_from, rec.scheduled)
            child("prefill", rec.scheduled, rec.first_token)
            child("decode", rec.first_token, rec.finished)
        attrs = {
            "gen_ai.operation.name": rec.operation,
            "gen_ai.provider.name": "jkv",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.id": rec.request_id,
            "gen_ai.usage.input_tokens": rec.prompt_tokens,
            "gen_ai.usage.output_tokens": rec.completion_tokens,
            "jkv.cached_tokens": rec.cached_tokens,
            "jkv.response_cache": rec.cache or "miss",
            "jkv.pages": rec.pages,
        }
        for name, value in (
            ("gen_ai.request.max_tokens", rec.max_tokens),
            ("gen_ai.request.temperature", rec.temperature),
            ("gen_ai.request.top_p", rec.top_p),
            ("gen_ai.request.seed", rec.seed),
        ):
            if value is not None:
                attrs[name] = value
        if rec.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = [rec.finish_reason]
        if rec.first_token is not None:
            attrs["gen_ai.server.time_to_first_token"] = rec.first_token - rec.arrival
        if rec.error is not None:
            attrs["error.type"] = rec.error
            span.set_status(trace.Status(trace.StatusCode.ERROR, rec.error))
        span.set_attributes(attrs)
        span.end(end_time=self.ns(rec.finished))


def _tenant_hash(salt: str | None) -> str | None:
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:16]


def _tracer(exporter):
    """A tracer of our own provider (the global one is left alone), or None when tracing is off."""
    env = os.environ
    wanted = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    off = (
        env.get("OTEL_SDK_DISABLED", "").lower() == "true"
        or env.get("OTEL_TRACES_EXPORTER") == "none"
    )
    if exporter is None and (not wanted or off):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "jkv")})
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer("jkv.serve")


class JsonFormatter(logging.Formatter):
    """Log records as one JSON object per line (a record whose message is JSON is merged in)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        message = record.getMessage()
        try:
            fields = json.loads(message)
        except ValueError:
            fields = None
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = message
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)
