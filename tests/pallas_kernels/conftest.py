"""Shared fixtures of the kernel tests (interpret mode on CPU, Triton lowering without a GPU).

Poisoning: the Pallas interpreter fills every output it does not alias with NaN (integers with
their minimum), so a kernel that skips an element shows up as NaN; aliased outputs are poisoned
by the tests themselves (NaN-filled buffers, NaN planted in slots past each length).
Random inputs are fresh per test case: the key mixes the case id with a session seed
(`JKV_TEST_SEED`, printed in the header; random when unset).
"""

from __future__ import annotations

import os
import random
import zlib

import jax
import numpy as np
import pytest

SEED = int(os.environ.get("JKV_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["JKV_TEST_SEED"] = str(SEED)  # xdist workers inherit the controller's seed


def pytest_report_header(config):
    return f"pallas_kernels: JKV_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter):
    lines = []
    for report in terminalreporter.stats.get("passed", []):
        for name, value in report.user_properties:
            if name.startswith("fp8_"):
                lines.append(f"{report.nodeid.split('::')[-1]}: {name} = {value:.4f}")
    if lines:
        terminalreporter.section("FP8 error against the unquantised float32 reference")
        for line in sorted(lines):
            terminalreporter.write_line(line)


@pytest.fixture
def rng(request):
    """A numpy Generator of its own for every test case (numpy: no XLA compile per input)."""
    return np.random.default_rng([zlib.crc32(request.node.nodeid.encode()), SEED])


def _rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has any)."""
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _ragged_lengths(rng, b: int, kh: int, s: int) -> np.ndarray:
    """[B, K] int32 lengths that include 0, 1 and S (and random others)."""
    lengths = rng.integers(0, s + 1, size=b * kh).astype(np.int32)
    lengths[:3] = [0, 1, s][: min(3, b * kh)]
    return lengths.reshape(b, kh)


def _poison_past(x, lengths, value=np.nan) -> np.ndarray:
    """Plants `value` in every slot at or past the length: x [B, K, S, ...]."""
    x = np.array(x)
    dead = np.arange(x.shape[2]) >= np.asarray(lengths)[..., None]
    x[dead] = np.asarray(value).astype(x.dtype)
    return x


def _lower_for_cuda(fn, *args, **kwargs) -> str:
    """Lowers fn(*args, **kwargs) for CUDA on this CPU-only machine (through Triton IR)."""
    text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text, "expected a Triton custom call"
    return text


# The helpers are fixtures so the test files never import this conftest by name.
@pytest.fixture
def rel_err():
    return _rel_err


@pytest.fixture
def ragged_lengths():
    return _ragged_lengths


@pytest.fixture
def poison_past():
    return _poison_past


@pytest.fixture
def lower_for_cuda():
    return _lower_for_cuda
