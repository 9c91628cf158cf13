import os

import pytest
import torch

# Only loopback traffic in tests: tcp runs on the "lo" domain.
PROVIDERS = {
    "tcp": dict(provider="tcp", domains=["lo"]),
    "shm": dict(provider="shm"),
}


def engine_kwargs(provider: str, **extra) -> dict:
    return {**PROVIDERS[provider], **extra}


@pytest.fixture(params=sorted(PROVIDERS))
def provider(request) -> str:
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
