import os

# A thread waiting at an OpenMP barrier sleeps instead of spinning. Set before torch loads its OpenMP runtime, here
# and in every process a test starts: a run or benchmark that asks for 2 threads (``fedsight bench``, torchrun ranks)
# on 2 cores that the other pytest worker also uses spun for its descheduled partner: 60 to 100 times slower a round
# than at one thread, and 82 s against 15 s for the whole ``fedsight bench -w cnn --clients 3 --rounds 2 --no-flower
# --no-memory`` beside two busy processes on 2 cores (one run each).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

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
