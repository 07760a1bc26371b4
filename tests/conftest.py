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
