import pytest
import torch

from fedsight.plugins import load_builtin

load_builtin()  # every built-in task, dataset, model and recipe part, as the CLI and the API have them


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # tiny models: one intra-op thread is faster and immune to oversubscription on 2-core machines
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


from hypothesis import settings  # noqa: E402

# CI machines are small and shared: no per-example deadline, a bounded number of examples
settings.register_profile("fedsight", deadline=None, max_examples=50)
settings.load_profile("fedsight")
