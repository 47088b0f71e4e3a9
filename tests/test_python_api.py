"""The Python API as a notebook user meets it: the example of docs/api.md, run as written, and its promises."""

import json
import re
from pathlib import Path

import pytest
import torch

import fedsight
from helpers import tiny

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture
def clean_registries():
    """Names a test registers are gone afterwards (other tests enumerate the registries)."""
    from fedsight.config import _ALL_REGISTRIES

    before = {id(reg): dict(reg._entries) for reg in _ALL_REGISTRIES()}
    yield
    for reg in _ALL_REGISTRIES():
        reg._entries.clear()
        reg._entries.update(before[id(reg)])


def _documented_example() -> str:
    text = API_PAGE.read_text(encoding="utf-8")
    return re.search(r"<!-- python-api -->\n```python\n(.*?)```", text, re.S).group(1)


def test_the_documented_example_runs_as_written(tmp_path, monkeypatch, clean_registries, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "notebook"}
    exec(compile(_documented_example(), "docs/api.md", "exec"), namespace)
    result = namespace["result"]
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result.status == "complete" and [r["round"] for r in result.history] == [0, 1, 2, 3, 4, 5, 6]
    assert result.final["test/acc"] == rows[-1]["test/acc"] > 0.5  # the API reads what the run wrote
    printed = capsys.readouterr().out
    assert f"test/acc {rows[-1]['test/acc']:.3f}" in printed
    # the loaded model is the trained one: it reproduces the run's final test accuracy
    from fedsight.api import build_task

    metrics = build_task(result.config).evaluate(namespace["model"], "test")
    assert metrics["acc"] == pytest.approx(rows[-1]["test/acc"], abs=1e-9)
    # a notebook cell run twice registers the same definition again without an error
    exec(compile(_documented_example(), "docs/api.md", "exec"), namespace)


def test_run_returns_a_list_for_a_sweep_and_variants_pick(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 2})
    raw["sweep"] = {"seeds": [0, 1]}
    raw["variants"] = [{"name": "a"}, {"name": "b", "train": {"lr": 0.05}}]
    results = fedsight.run(raw)
    assert [(r.run_dir.parent.name, r.run_dir.name) for r in results] == [
        ("a", "seed0"), ("a", "seed1"), ("b", "seed0"), ("b", "seed1")]
    only = fedsight.run(raw, variants=["b"], **{"sweep.seeds": [1]})
    assert only.run_dir == results[3].run_dir and only.final == results[3].final  # complete: read back


def test_bad_input_raises_config_error_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fedsight.ConfigError, match="train.lr = 0"):
        fedsight.run(tiny(), train__lr=0)
    with pytest.raises(fedsight.ConfigError, match="model.widht"):
        fedsight.run(tiny(**{"model.widht": 3}))
    assert not (tmp_path / "runs").exists()


def test_load_run_builds_the_model_without_the_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = fedsight.run(tiny(**{"server.rounds": 1}))
    monkeypatch.setattr("fedsight.api.build_task", lambda cfg: pytest.fail("load_run loaded the data"))
    monkeypatch.setattr("fedsight.build.build_task", lambda cfg: pytest.fail("load_run loaded the data"))
    loaded = fedsight.load_run(result.run_dir)
    from safetensors.torch import load_file

    saved = load_file(result.run_dir / "model.safetensors")
    assert all(torch.equal(v, saved[k]) for k, v in loaded.model.state_dict().items())


def test_plugins_listed_in_a_toml_config_register_before_validation(tmp_path, monkeypatch, clean_registries):
    import sys

    import tomli_w

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lab_parts.py").write_text(
        "from fedsight.registry import PARTITIONERS\n"
        "from fedsight.data.partition import iid\n"
        "PARTITIONERS.register('lab_iid', help='iid, by another name')(lambda p, **kw: iid(p, **kw))\n")
    raw = tiny(**{"server.rounds": 1})
    raw["partition"] = {"name": "lab_iid", "num_clients": 4}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    monkeypatch.delitem(sys.modules, "lab_parts", raising=False)
    with pytest.raises(fedsight.ConfigError, match="lab_iid"):
        fedsight.run(tmp_path / "c.toml")  # without the plugin the name is unknown
    raw["plugins"] = ["lab_parts"]
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    assert fedsight.run(tmp_path / "c.toml").status == "complete"
    raw["plugins"] = ["no_such_module"]
    with pytest.raises(fedsight.ConfigError, match="plugins: cannot import 'no_such_module'"):
        fedsight.run(raw)
    monkeypatch.delitem(sys.modules, "lab_parts", raising=False)


def test_a_plugin_that_fails_to_import_is_one_config_error_naming_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_parts.py").write_text("raise RuntimeError('lab server unreachable')\n")
    monkeypatch.delitem(sys.modules, "broken_parts", raising=False)
    raw = tiny(**{"server.rounds": 1})
    raw["plugins"] = ["broken_parts"]
    with pytest.raises(fedsight.ConfigError,
                       match=r"plugins: cannot import 'broken_parts' \(RuntimeError: lab server unreachable\)"):
        fedsight.run(raw)
    assert not (tmp_path / "runs").exists()


def test_registering_a_name_twice_is_refused_unless_it_is_the_same_definition(clean_registries):
    from fedsight.registry import PARTITIONERS

    def lab_split(params, **context):
        return None

    PARTITIONERS.register("lab_split")(lab_split)
    PARTITIONERS.register("lab_split")(lab_split)  # the same definition again (a notebook cell run twice)
    assert PARTITIONERS.get("lab_split").factory is lab_split

    def other(params, **context):
        return None

    with pytest.raises(ValueError, match="partitioner 'lab_split' is registered twice"):
        PARTITIONERS.register("lab_split")(other)
    assert PARTITIONERS.get("lab_split").factory is lab_split  # the first one stays
    with pytest.raises(ValueError, match="registered twice"):
        PARTITIONERS.register("iid")(other)  # a built-in name


def test_load_run_of_a_run_without_model_io_is_a_config_error_naming_run_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = fedsight.run(tiny(**{"server.rounds": 1}))
    meta_path = result.run_dir / "run.json"
    meta = json.loads(meta_path.read_text())
    del meta["model_io"]  # as a run written before FedSight recorded it
    meta_path.write_text(json.dumps(meta))
    loaded = fedsight.load_run(result.run_dir)
    assert loaded.status == "complete" and loaded.final == result.final  # the rest reads back
    with pytest.raises(fedsight.ConfigError, match=r"run\.json: no model_io .*build_task\(config\)\.build_model\(\)"):
        loaded.model


def test_client_metrics_and_dataframe_read_what_the_run_wrote(tmp_path, monkeypatch):
    import sys

    import pandas as pd

    monkeypatch.chdir(tmp_path)
    result = fedsight.run(tiny(**{"server.rounds": 4, "eval.every": 2}))
    lines = [json.loads(x) for x in (result.run_dir / "client_metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in result.client_metrics] == [2, 4] and result.client_metrics == lines
    assert len(result.client_metrics[0]["clients"]) == 6  # tiny(): 6 clients, each with a local test set
    frame = result.dataframe()
    assert isinstance(frame, pd.DataFrame) and list(frame.index) == [r["round"] for r in result.history]
    assert frame.loc[4, "test/acc"] == result.final["test/acc"]
    assert frame["test/acc"].dropna().index.tolist() == [r["round"] for r in result.history if "test/acc" in r]
    monkeypatch.setitem(sys.modules, "pandas", None)  # an environment without pandas
    with pytest.raises(ImportError, match=r"needs pandas \(pip install pandas\); RunResult.history"):
        result.dataframe()
