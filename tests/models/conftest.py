import pytest
import torch

from workbench.models import make_tiny, train_tokenizer


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Another engineer's Ray tests share these 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny("1m", tmp_path_factory.mktemp("kit") / "tiny-1m", seed=0)
