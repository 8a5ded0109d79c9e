"""Shared test setup: offline hub, deterministic threads, GPU marker handling."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))
# bench/benchkit (the benchmark workloads W1/W3/tiny and measurement helpers) lives outside the
# package; appended, so no bench script shadows an installed module
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``):
    their exactness does not depend on how a reduction is split over threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch and counts only its own graphs (``counters``): modules that
    compile use it for every test (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
