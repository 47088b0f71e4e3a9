"""Where tensors live and how many CPU threads torch uses.

**Devices** (``[engine] device``): ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else the CPU),
``"cpu"``, ``"cuda"`` or ``"cuda:N"``. The global model, the clients' work model, every batch, client
state read back from disk, aggregation and the server optimizer live on that device. What is written to
disk (checkpoints, client state, model files) is always CPU tensors, so a run started on a GPU resumes
on a CPU and vice versa.

**Threads** (``[engine] threads``): torch's intra-op thread pool. With the default (``"auto"``),
FedSight uses one thread per process: the models of federated simulations are small and run as many
short steps, where a thread pool's synchronisation costs more than it gains, and a second busy process
on the machine makes a multi-threaded pool far slower (``benchmarks/threads.py`` measures this). An
integer sets it explicitly; the run records the value in ``run.json``.

**Freed memory** (``[engine] heap_keep_mb``): torch's CPU allocator has no cache of its own, and glibc's
``malloc`` hands large freed blocks back to the operating system, so every large tensor of a training step
(the feature maps and stacked weights of a vectorised step are megabytes each) is fresh memory that the kernel
maps in page by page, every step: about 5,500 page faults, a tenth of the round, on the CNN of ``fedsight
bench``. On a CPU device FedSight has glibc keep up to ``heap_keep_mb`` MiB of freed memory for reuse and
serve blocks up to 32 MiB from it (``keep_freed_memory``). ``0`` leaves the C allocator's defaults; the setting
holds for the rest of the process; on a C library without ``mallopt`` (macOS) it does nothing.

**Determinism** (``[engine] deterministic``): on the CPU every run of a config is bit-identical anyway.
On CUDA, ``deterministic = true`` makes torch use deterministic kernels (``torch.use_deterministic_
algorithms``; cuDNN benchmark off; ``CUBLAS_WORKSPACE_CONFIG`` set), which gives bit-identical repeats on
the same GPU model, driver and torch build, at some speed cost; operations without a deterministic CUDA
kernel then raise. Without it, CUDA results vary in the last bits between runs (atomics in reductions,
cuDNN algorithm choice), and a resumed run equals an uninterrupted one only to float tolerance. Results
never match bit for bit across devices (CPU vs GPU) or GPU models.

**Machine** (``run.json``'s ``machine``, each session): on the CPU too, bit-identical means the same CPU kernels,
so each session records the CPU model and its vector extensions, the capability torch's kernels dispatch to
(``ATEN_CPU_CAPABILITY=avx2`` or ``default`` lowers it, as oneDNN's ``ONEDNN_MAX_CPU_ISA`` and MKL's
``MKL_ENABLE_INSTRUCTIONS`` lower theirs: another CPU's kernels on this one), BLAS/LAPACK, MKL and oneDNN.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
from torch import nn

from .errors import ConfigError


def resolve_device(spec: str = "auto", key: str = "engine.device") -> torch.device:
    """The ``torch.device`` of an ``engine.device`` value; a CUDA device that is not there is a
    ``ConfigError`` naming the setting (``key``)."""
    spec = (spec or "auto").strip()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f'{key} = {spec!r}: expected "auto", "cpu", "cuda" or "cuda:N"') from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f'{key} = {spec!r}: expected "auto", "cpu", "cuda" or "cuda:N"')
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{key} = {spec!r} but CUDA is not available here (torch {torch.__version__}"
            f"{', a build without CUDA' if torch.version.cuda is None else ', no GPU visible'}); use \"auto\" or \"cpu\""
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{key} = {spec!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter or buffer (CPU for a model without state)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (a tensor, or tuples/lists/dicts of them) on ``device``; a no-op for tensors already
    there. Pinned CPU tensors copy asynchronously."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=obj.is_pinned())
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies (what is written to disk or sent over the wire)."""
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


#: glibc's ``mallopt`` parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX = -1, -3, 32 << 20


def keep_freed_memory(mib: int) -> bool:
    """Have the C allocator keep up to ``mib`` MiB of freed memory at the top of the heap (glibc's
    ``M_TRIM_THRESHOLD``) and serve blocks up to 32 MiB from the heap rather than from fresh ``mmap``s
    (``M_MMAP_THRESHOLD``), so that a training step's large tensors reuse the pages of the step before (module
    docstring). Returns whether it applied: False for ``mib = 0`` (nothing changed) or a C library without
    ``mallopt``."""
    if mib <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, mib << 20))


#: the thread count "auto" resolves to (see the module docstring and benchmarks/threads.py)
AUTO_THREADS = 1


def machine_cpus() -> int:
    """The CPUs of this machine (``os.cpu_count``; 1 where unknown)."""
    return os.cpu_count() or 1


def configure_threads(setting: int | str | None) -> int:
    """Set torch's intra-op threads from ``engine.threads`` (an int, ``"auto"`` or None = auto) and
    return the number in use: at most the machine's CPUs. A count above them (a run made on a larger machine,
    resumed here) runs with one thread per CPU and says so in a warning; ``run.json`` records the count each
    session used (``threads``) and, when it was lowered, the count asked for (``threads_requested``). Results
    are bit-identical only at the same thread count, so such a resumed run is not bit-identical to the
    uninterrupted one."""
    n = AUTO_THREADS if setting in (None, "auto") else int(setting)
    if n > (cpus := machine_cpus()):
        import warnings

        warnings.warn(f"engine.threads = {n}: this machine has {cpus} CPUs; running with {cpus} threads (results are "
                      f"bit-identical only at the same thread count)", RuntimeWarning, stacklevel=2)
        n = cpus
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def configure_determinism(deterministic: bool, device: torch.device) -> None:
    """Deterministic CUDA kernels on or off (a no-op on the CPU, which is deterministic anyway)."""
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic


def describe(device: torch.device) -> dict[str, Any]:
    """What ``run.json`` records about where a session ran (``machine``: the CPU and torch's CPU kernels)."""
    out: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["machine"] = machine()
    return out


#: the CPU flags that decide which kernels torch, MKL and oneDNN run (``avx512*`` and ``amx*`` by prefix; ARM's
#: ``asimd``/``sve``)
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "asimd", "sve", "sve2")
CPU_FLAG_PREFIXES = ("avx512", "amx", "avx_vnni")
#: environment variables that change which kernels run or how many threads they use (recorded when set)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
              "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and its vector extensions among ``CPU_FLAGS`` (sorted), from ``/proc/cpuinfo`` (or
    the text ``cpuinfo``); elsewhere ``platform.processor()`` and no flags."""
    import platform

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # (the first processor's block: every core of a machine is one model)
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    keep = sorted({f for f in flags if f in CPU_FLAGS or f.startswith(CPU_FLAG_PREFIXES)})
    return {"cpu": model, "arch": platform.machine(), "cpu_flags": keep, "logical_cpus": os.cpu_count()}


def torch_build() -> dict[str, Any]:
    """torch's CPU kernels: the capability its vectorised kernels dispatch to (``ATEN_CPU_CAPABILITY`` lowers
    it), BLAS and LAPACK, oneDNN (MKL-DNN) and MKL versions and the parallel backend (``torch.__config__``)."""
    import re

    shown = torch.__config__.show()
    parallel = torch.__config__.parallel_info()
    settings = dict(re.findall(r"(\w+)=([^,\s]*)", shown.split("Build settings:", 1)[-1]))
    onednn = re.search(r"MKL-DNN v([\w.]+)", shown)
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", shown)
    backend = re.search(r"ATen parallel backend: (.+)", parallel)
    out: dict[str, Any] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": settings.get("BLAS_INFO"), "lapack": settings.get("LAPACK_INFO"),
        "mkldnn": torch.backends.mkldnn.is_available(), "onednn": onednn.group(1) if onednn else None,
        "mkl": mkl.group(1) if mkl else None,
        "parallel_backend": backend.group(1).strip() if backend else None,
        "interop_threads": torch.get_num_interop_threads(),
    }
    env = {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}
    if env:
        out["env"] = env
    return out


def machine() -> dict[str, Any]:
    """``run.json``'s ``machine``: the CPU (``cpu_info``) and torch's CPU kernels (``torch_build``), which decide
    how a float result rounds: another CPU model, capability or library version gives other last bits."""
    return {**cpu_info(), **torch_build()}
