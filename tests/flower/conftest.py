"""Flower adapter tests: every test module here sets ``pytestmark = pytest.mark.flower`` (select with
``-m flower``, skip with ``-m "not flower"``); they run by default. Flower processes get a private FLWR_HOME, no telemetry and
no runtime dependency installation."""

import os

import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: pip install -e '.[flower]'")

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
