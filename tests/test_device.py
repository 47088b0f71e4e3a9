"""Devices, threads and moving a run between devices.

Tests marked ``cuda`` need a GPU and are skipped without one (CI has none); run them on a GPU machine
with ``python -m pytest -m cuda``."""

from __future__ import annotations

import copy
import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fedsight.api import build_simulation, execute, load_run_config
from fedsight.config import ConfigError, validate
from fedsight.device import cpu_info, resolve_device

from helpers import tiny

HAS_CUDA = torch.cuda.is_available()


def cuda(test):
    """Marked ``cuda`` (select with ``-m cuda``) and skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


def models_close(a, b, atol):
    ma, mb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(ma) == list(mb)
    for k in ma:
        torch.testing.assert_close(ma[k].double(), mb[k].double(), rtol=0, atol=atol, msg=k)


# -- everywhere ----------------------------------------------------------------------------------------------


def test_device_values_are_checked_at_config_time():
    for bad in ("gpu", "cuda:x", "tpu", ""):
        with pytest.raises(ConfigError, match="engine.device"):
            validate(tiny(**{"engine.device": bad}))
    with pytest.raises(ConfigError, match="engine.threads"):
        validate(tiny(**{"engine.threads": 0}))
    for bad in (-1, 2048, "lots"):
        with pytest.raises(ConfigError, match="engine.heap_keep_mb"):
            validate(tiny(**{"engine.heap_keep_mb": bad}))
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")


_FAULTS = """
import resource, sys
from fedsight.api import build_simulation
from fedsight.bench import cnn_workload
from fedsight.config import validate
sim = build_simulation(validate({**cnn_workload(10, 4), "engine": {"device": "cpu", "vectorize": True,
                                                                   "heap_keep_mb": int(sys.argv[1])}}))
sim.train_round(1), sim.train_round(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sim.train_round(3), sim.train_round(4)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _has_mallopt() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallopt(), reason="glibc's mallopt")
def test_freed_memory_is_kept_for_the_next_steps():
    """``engine.heap_keep_mb``: the large tensors of vectorised rounds reuse the memory freed by the steps before
    instead of faulting in fresh pages (each setting in a fresh process: it holds for the rest of a process).

    Both processes start with glibc's static thresholds (128 KiB; the environment variables are ``mallopt``'s
    settings): by default glibc moves its thresholds up after the program frees large blocks, so whether it keeps
    freed memory depends on the order of the allocations before, and two rounds without the setting faulted 3 to
    10,000 times in different runs. With the static thresholds it hands every large freed block back (about 50,000
    faults), the behaviour the setting is for; ``heap_keep_mb`` sets its own thresholds over them."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
    faults = {}
    for keep in (0, 256):
        out = subprocess.run([sys.executable, "-c", _FAULTS, str(keep)], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[keep] = int(out.stdout.split()[-1])
    assert faults[256] * 10 < faults[0], faults


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_fails_before_anything_is_written(tmp_path):
    cfg = validate(tiny(**{"engine.device": "cuda"}))
    with pytest.raises(ConfigError, match=r"engine.device = 'cuda' but CUDA is not available"):
        execute(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_threads_default_to_one_and_each_session_is_recorded(tmp_path):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        execute(validate(tiny(**{"server.rounds": 2})), tmp_path / "run", stop_after=1)
        assert torch.get_num_threads() == 1  # engine.threads = "auto"
        cfg = load_run_config(tmp_path / "run", {"threads": 2, "vectorize": True})
        execute(cfg, tmp_path / "run")  # resume with another engine: the same experiment
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
    sessions = json.loads((tmp_path / "run" / "run.json").read_text())["sessions"]
    assert [(s["device"], s["threads"]) for s in sessions] == [("cpu", 1), ("cpu", 2)]
    assert [s["vectorize"] for s in sessions] == [False, True]  # "auto" on a CPU trains one client at a time
    assert all(s["torch"] == torch.__version__ for s in sessions)
    # the run directory keeps the config it was started with
    assert json.loads((tmp_path / "run" / "config.json").read_text())["engine"]["threads"] == "auto"


def test_resume_with_another_engine_is_the_same_run_but_another_experiment_is_refused(tmp_path):
    execute(validate(tiny(**{"server.rounds": 2, "engine.threads": 1})), tmp_path / "run", stop_after=1)
    out = execute(validate(tiny(**{"server.rounds": 2, "engine.device": "cpu"})), tmp_path / "run")
    assert out.status == "complete"
    with pytest.raises(ConfigError, match="different config"):
        execute(validate(tiny(**{"server.rounds": 2, "train.lr": 0.3})), tmp_path / "run")


def test_checkpoints_and_client_state_are_cpu_tensors(tmp_path):
    execute(validate(tiny(**{"recipe.components": ["scaffold"], "server.rounds": 2})), tmp_path / "run")
    files = list((tmp_path / "run").rglob("*.safetensors"))
    assert any("client_state" in str(f) for f in files) and any("checkpoints" in str(f) for f in files)
    for f in files:  # safetensors stores no device: loading gives CPU tensors wherever the run computed
        assert all(t.device.type == "cpu" for t in load_file(str(f)).values())


# -- on a GPU ------------------------------------------------------------------------------------------------


@cuda
def test_a_gpu_run_resumes_on_the_cpu_and_back(tmp_path):
    """A run started on the GPU and finished on the CPU ends where the uninterrupted GPU run does, to
    float tolerance (kernels differ between devices); and the other way round."""
    over = {"recipe.components": ["scaffold"], "model.norm": "batch", "server.rounds": 4, "eval.every": 2}
    gpu = validate(tiny(**{**over, "engine.device": "cuda"}))
    execute(gpu, tmp_path / "gpu")
    execute(gpu, tmp_path / "g2c", stop_after=2)
    execute(load_run_config(tmp_path / "g2c", {"device": "cpu"}), tmp_path / "g2c")
    models_close(tmp_path / "gpu", tmp_path / "g2c", atol=1e-4)
    cpu = validate(tiny(**{**over, "engine.device": "cpu"}))
    execute(cpu, tmp_path / "c2g", stop_after=2)
    execute(load_run_config(tmp_path / "c2g", {"device": "cuda"}), tmp_path / "c2g")
    models_close(tmp_path / "gpu", tmp_path / "c2g", atol=1e-4)
    devices = [s["device"] for s in json.loads((tmp_path / "g2c" / "run.json").read_text())["sessions"]]
    assert devices[0].startswith("cuda") and devices[1] == "cpu"


@cuda
def test_gpu_and_cpu_runs_agree_and_deterministic_gpu_runs_repeat_bit_for_bit(tmp_path):
    over = {"server.rounds": 3, "model.norm": "batch", "engine.deterministic": True}
    execute(validate(tiny(**{**over, "engine.device": "cuda"})), tmp_path / "a")
    execute(validate(tiny(**{**over, "engine.device": "cuda"})), tmp_path / "b")
    execute(validate(tiny(**{**over, "engine.device": "cpu"})), tmp_path / "c")
    models_close(tmp_path / "a", tmp_path / "b", atol=0)
    models_close(tmp_path / "a", tmp_path / "c", atol=1e-4)


@cuda
def test_everything_lives_on_the_gpu(tmp_path):
    sim = build_simulation(validate(tiny(**{"engine.device": "cuda", "recipe.components": ["scaffold"]})))
    assert all(t.device.type == "cuda" for t in sim.global_model.state_dict().values())
    assert all(t.device.type == "cuda" for t in sim.work_model.state_dict().values())
    assert sim.task.pool_x.device.type == "cuda"  # small in-memory pools move once
    sim.run()
    sc = sim.recipe.components[0]
    assert all(v.device.type == "cuda" for v in sc.c.values())


@cuda
@pytest.mark.parametrize("case", ["fedvg", "fed3r", "fedncm", "oll", "ditto", "pfedme", "fedbn", "elastic", "fednova",
                                  "krum", "feddyn", "fedadam"])
def test_recipe_parts_on_the_gpu_match_the_cpu(tmp_path, case):
    over = {
        "fedvg": {"recipe.weighting": "fedvg", "validation.source": "carve"},
        "fed3r": {"recipe.components": ["fed3r"]}, "fedncm": {"recipe.components": ["fedncm"]},
        "oll": {"recipe.components": ["oll"], "recipe.sharing": "local"}, "ditto": {"recipe.components": ["ditto"]},
        "pfedme": {"recipe.components": ["pfedme"]}, "fedbn": {"recipe.sharing": "fedbn", "model.norm": "batch"},
        "elastic": {"recipe.components": ["elastic"]}, "fednova": {"recipe.components": ["fednova"]},
        "krum": {"recipe.aggregator": {"name": "krum", "byzantine": 0}},
        "feddyn": {"recipe.components": ["feddyn"]}, "fedadam": {"server.optimizer": "fedadam"},
    }[case]
    base = {"server.rounds": 2, **over}
    execute(validate(tiny(**{**base, "engine.device": "cuda"})), tmp_path / "gpu")
    execute(validate(tiny(**{**base, "engine.device": "cpu"})), tmp_path / "cpu")
    models_close(tmp_path / "gpu", tmp_path / "cpu", atol=1e-3)


@cuda
def test_on_disk_images_with_pinned_batches_on_the_gpu(tmp_path):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for k in range(2):
        (tmp_path / "tree" / f"c{k}").mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "tree" / f"c{k}" / f"{i}.png")
    data = {"name": "imagefolder", "train_dir": str(tmp_path / "tree"), "image_size": 8, "augment": "crop_flip"}
    raw = tiny(**{"data": data, "partition.num_clients": 3, "server.clients_per_round": 2, "engine.device": "cuda"})
    execute(validate(raw), tmp_path / "img")
    cpu = copy.deepcopy(raw)
    cpu["engine"]["device"] = "cpu"
    execute(validate(cpu), tmp_path / "img_cpu")
    models_close(tmp_path / "img", tmp_path / "img_cpu", atol=1e-3)


_RUN = """
import json, sys
from fedsight.api import execute
from fedsight.config import validate
execute(validate(json.loads(sys.argv[1])), sys.argv[2])
"""

#: the fields of ``run.json``'s ``machine`` (``fedsight.device.machine``)
MACHINE = {"cpu", "arch", "cpu_flags", "logical_cpus", "cpu_capability", "blas", "lapack", "mkldnn", "onednn", "mkl",
           "parallel_backend", "interop_threads"}


def test_run_json_records_the_cpu_and_torch_kernels_and_a_lowered_capability(tmp_path):
    """Each session records the machine's CPU (model, vector extensions) and torch's CPU kernels (the capability
    its kernels dispatch to, BLAS/LAPACK, oneDNN): what decides how its floats round. A run in a process with
    ``ATEN_CPU_CAPABILITY=default`` (torch's scalar kernels, as a CPU without AVX would run) records that."""
    raw = tiny(**{"server.rounds": 1, "eval.local": False})
    execute(validate(raw), tmp_path / "here")
    m = json.loads((tmp_path / "here" / "run.json").read_text())["sessions"][0]["machine"]
    assert set(m) >= MACHINE, set(m) ^ MACHINE
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["mkldnn"] == torch.backends.mkldnn.is_available() and m["blas"] and m["interop_threads"] >= 1
    assert m["cpu"] and m["logical_cpus"] == os.cpu_count()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
        flags = set(next((ln.split(":", 1)[1].split() for ln in first.splitlines()
                          if ln.split(":")[0].strip() in ("flags", "Features")), []))
        assert set(m["cpu_flags"]) <= flags and ("avx2" in flags) == ("avx2" in m["cpu_flags"])
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", _RUN, json.dumps(raw), str(tmp_path / "scalar")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lowered = json.loads((tmp_path / "scalar" / "run.json").read_text())["sessions"][0]["machine"]
    assert lowered["cpu_capability"] == "DEFAULT" and lowered["env"]["ATEN_CPU_CAPABILITY"] == "default"
    assert {k: v for k, v in lowered.items() if k not in ("cpu_capability", "env")} == {
        k: v for k, v in m.items() if k not in ("cpu_capability", "env")}


def test_cpu_info_keeps_the_model_and_the_vector_extensions():
    epyc = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
            "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    assert cpu_info(epyc)["cpu"] == "AMD EPYC 7B13"
    assert cpu_info(epyc)["cpu_flags"] == ["avx", "avx2", "f16c", "fma", "sse4_2"]
    xeon = "model name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_vnni amx_tile amx_bf16 sse2\n"
    assert cpu_info(xeon)["cpu_flags"] == ["amx_bf16", "amx_tile", "avx2", "avx512_vnni", "avx512f"]
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert cpu_info(arm)["cpu_flags"] == ["asimd", "sve"] and cpu_info(arm)["cpu"]  # (platform.processor() or the arch)
