"""The server tests' fixtures: the demo model, and `jkv.serve.server.Server`s run by uvicorn in a
thread on a free loopback port (real HTTP; the official `openai` client talks to them)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_harness import Running

import jkv
from jkv.serve.server import Server


@pytest.fixture(scope="session")
def demo_params():
    return jkv.load("demo")


@pytest.fixture
def serve():
    """`serve(server) -> Running`; every server started is stopped after the test."""
    started: list[Running] = []

    def start(server: Server) -> Running:
        started.append(Running(server))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def spans():
    return InMemorySpanExporter()
