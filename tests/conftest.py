import os

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


# and so do the processes tests start (CLI runs, Flower's processes, spawned workers): two pytest workers on two
# cores already use both
os.environ.setdefault("OMP_NUM_THREADS", "1")


from hypothesis import settings  # noqa: E402

# CI machines are small and shared: no per-example deadline, a bounded number of examples. Under CI (CI=true) the
# examples are derandomized, so that a landing is not decided by which examples a run happened to draw; everywhere
# else they are random, and what a developer's run finds is kept in .hypothesis/ and tried first next time (a
# found case becomes a plain regression test, as tests/data/test_seg_pipeline.py's luma test).
settings.register_profile("fedsight", deadline=None, max_examples=50,
                          derandomize=os.environ.get("CI", "").lower() in ("true", "1"))
settings.load_profile("fedsight")


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` cases run only with the suite's slow flag, ``FEDSIGHT_SLOW=1`` (docs/testing.md, "The slow flag")."""
    if os.environ.get("FEDSIGHT_SLOW", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: runs with FEDSIGHT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The fuzz suite's executed cases (tests/fuzz_helpers.py), when it ran: docs/guarantees.md quotes these counts."""
    import sys

    fuzz = sys.modules.get("fuzz_helpers")
    if fuzz is not None and fuzz.COUNTS:
        mode = "slow (FEDSIGHT_FUZZ_SLOW=1)" if fuzz.SLOW else "fast (CI)"
        terminalreporter.write_sep("-", f"fuzz cases executed, {mode} mode")
        for name, n in sorted(fuzz.COUNTS.items()):
            terminalreporter.write_line(f"{name}: {n}")
        terminalreporter.write_line(f"total: {sum(fuzz.COUNTS.values())}")
