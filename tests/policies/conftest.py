"""Fixtures of the policy tests."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator of its own for every test case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
