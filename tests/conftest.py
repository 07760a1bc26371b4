import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.data.synthetic import make_synthetic_precomp


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    return make_synthetic_precomp(tmp_path_factory.mktemp("syn"), n_train=240, n_dev=50, n_test=50, regions=10, dim=32, noise=0.8)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def reference_fixture_dir(name: str | None = None) -> Path:
    """Folder of the released-code parity fixtures (or one item's subfolder); skips the test when absent.

    `VSE_REFERENCE_FIXTURES` points at another set (e.g. the held-out one); default: the shared checkout's.
    """
    default = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "reference"
    root = Path(os.environ.get("VSE_REFERENCE_FIXTURES") or default)
    path = root / name if name else root
    if not path.is_dir():
        pytest.skip(f"reference fixtures not found at {path} (set VSE_REFERENCE_FIXTURES)")
    return path
