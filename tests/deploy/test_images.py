"""The container images without a Docker engine: the Dockerfiles parse as Docker parses
them and pass hadolint, they share one install script (shellcheck-clean), and that
script, run into a fresh virtual environment, installs a jaxserve whose `jaxserve serve`
answers requests.

The fresh venv gets the package as a built wheel with `--no-index`: its dependencies are
the ones this machine already has (a .pth file puts a mirror of this interpreter's
site-packages, less jaxserve, behind the venv's own), so pip resolves the wheel's
requirements against them with no network, in seconds. What it does not prove is that
PyPI serves them: that is the images' own build."""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import dockerfile
import httpx
import pytest

from tests.api.conftest import API_KEY, Server

ROOT = Path(__file__).parents[2]
DOCKER = ROOT / "deploy" / "docker"
INSTALL = DOCKER / "install.sh"
PLATFORMS = {"cpu": "", "cuda": "[gpu]", "tpu": "[tpu]"}
BIN = Path(sys.executable).parent   # hadolint and shellcheck come as pip packages


def commands(platform: str) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKER / f"Dockerfile.{platform}")))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dockerfile_is_multistage_non_root_and_runs_the_install_script(platform):
    cmds = commands(platform)
    stages = [c for c in cmds if c.cmd == "FROM"]
    assert len(stages) == 2 and stages[0].value[-2:] == ("AS", "build")
    runs = [c.value[0] for c in cmds if c.cmd == "RUN"]
    assert f"deploy/docker/install.sh /opt/jaxserve {platform} /src" in runs
    # The runtime stage: the venv from the build stage, a numeric non-root user
    # (Kubernetes' runAsNonRoot can check a number only), the server as entrypoint.
    runtime = cmds[cmds.index(stages[1]):]
    copied = [c for c in runtime if c.cmd == "COPY"]
    assert [c.flags for c in copied] == [("--from=build",)]
    (user,) = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) > 0
    (entry,) = [c.value for c in runtime if c.cmd == "ENTRYPOINT"]
    assert entry[:2] == ("jaxserve", "serve") and "0.0.0.0" in entry
    env = dict(zip(*[iter(next(c.value for c in runtime if c.cmd == "ENV"))] * 2))
    volumes = next(c.value for c in runtime if c.cmd == "VOLUME")
    for var in ("HF_HOME", "JAXSERVE_COMPILATION_CACHE"):
        assert env[var] in volumes, var
    assert "/models" in volumes


def test_dockerfiles_pass_hadolint_and_the_script_shellcheck():
    for name in [*PLATFORMS, "router"]:
        out = subprocess.run([BIN / "hadolint", "--no-color", DOCKER / f"Dockerfile.{name}"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([BIN / "shellcheck", INSTALL], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_install_script_refuses_an_unknown_platform(tmp_path):
    out = subprocess.run([INSTALL, str(tmp_path / "v"), "rocm"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown platform 'rocm'" in out.stderr
    assert not (tmp_path / "v").exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(ROOT)], check=True, timeout=600)
    (whl,) = out.glob("jaxserve-*.whl")
    return whl


def installed_here(into: Path) -> Path:
    """A folder that mirrors this interpreter's site-packages (symlinks), less jaxserve
    itself: the dependencies as pip would have installed them, for a .pth file."""
    into.mkdir()
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            if "jaxserve" not in entry.name.lower() and not (into / entry.name).exists():
                (into / entry.name).symlink_to(entry)
    return into


def test_install_script_in_a_fresh_venv_serves(wheel, tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (purelib,) = venv.glob("lib/python*/site-packages")
    # The dependencies: this machine's, behind the venv's own site-packages; pip
    # resolves the wheel's requirements against them (--no-index: nothing downloaded).
    deps = installed_here(tmp_path / "deps")
    (purelib / "_installed_here.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # not this tree
    out = subprocess.run(
        [INSTALL, str(venv), "cpu", str(wheel), "--", "--no-index", "--find-links",
         str(wheel.parent)],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Successfully installed jaxserve-0.1.0" in out.stdout
    assert "jaxserve 0.1.0" in out.stdout and "jax " in out.stdout
    # The venv imports its own copy of the packages the wheel holds.
    check = subprocess.run(
        [venv / "bin" / "python", "-c", "import jaxserve, models, sharding, pallas_kernels as p;"
         "print(jaxserve.__file__, models.__file__, sharding.__file__, p.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path)   # not this tree's cwd
    assert check.returncode == 0, check.stderr
    assert all(line.startswith(str(purelib)) for line in check.stdout.split()), check.stdout
    # The image's entrypoint, from the venv: the built-in tiny model answers.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    # (--enforce-eager: compile only what the one request needs, not the whole warmup)
    srv = Server(None, "--enforce-eager", "--max-num-seqs", "2",
                 launcher=(str(venv / "bin" / "jaxserve"), "serve"), log_dir=str(tmp_path))
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert srv.stop() == 0
