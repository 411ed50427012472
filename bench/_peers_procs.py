"""Starting the systems ``bench/peers.py`` compares, each on loopback, and installing the peers
into the bench's own folder (``bench/.peers/``, a venv; the test suite never installs them).

Each ``start_*`` returns a ``Started`` (the base URL, the model name, the pids whose CPU counts
as the system's own, and how to stop it) or raises ``FileNotFoundError`` when the system is not
installed. How the peers run here (versions, flags, Dynamo's loopback-only network namespace)
follows the project's research notes on peers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common.errors import PdserveError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_DIR = HERE / ".peers"
PEERS_VENV = PEERS_DIR / "venv"
DYNAMO_NETNS = "pdserve-peers"
VLLM_ROUTER = "vllm-router==0.1.17"
DYNAMO = ("ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1")
DYNAMO_DEPS = ("aiohttp<4,>=3.14.3", "kubernetes<33,>=32.0.1", "msgspec",
               "prometheus-client<1,>=0.23.1", "pyzmq>=26", "redis<9,>=6.2", "tqdm",
               "transformers>=4.56", "typing-extensions", "zstandard<1,>=0.23",
               "pydantic>=2.10.6,<=2.13.5", "uvloop", "jinja2")
WORKER_ARGS = ("--speedup", "1e9")
"""Sim workers: compute ~0; the KV payload at the sim engine's default scale (printed)."""


@dataclass(slots=True)
class Started:
    base_url: str
    model: str
    pids: list[int]
    """The system's own processes (their descendants count too)."""
    stops: list[Callable[[], None]] = field(default_factory=list)
    note: str = ""
    netns: str = ""
    """A network namespace the load generator must run in to reach it ("" = this one)."""
    grpc_address: str = ""
    """pdserve only: the router's gRPC address."""
    pool_address: str = ""
    """pdserve only: the decode pool manager's gRPC address."""
    store_url: str = ""
    """The floor only: its private Redis."""
    parts: dict[str, list[int]] = field(default_factory=dict)
    """Named parts of ``pids`` (a service, Redis, PostgreSQL) for a per-process CPU breakdown;
    empty where the system is one process or its parts are not told apart."""

    def stop(self) -> None:
        for stop in reversed(self.stops):
            with contextlib.suppress(Exception):
                stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout_s: float = 60.0, netns: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if netns:
                result = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                                         f"import urllib.request; urllib.request.urlopen({url!r})"],
                                        capture_output=True, timeout=5, check=False)
                if result.returncode == 0:
                    return
            else:
                with urllib.request.urlopen(url, timeout=2):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def wait_model(base_url: str, model: str, timeout_s: float = 60.0) -> None:
    """Until the system lists ``model`` (a router learns its workers from the pool stream)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as response:
                if model in response.read().decode():
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{base_url} does not list {model} after {timeout_s:.0f} s")


def _popen(argv: list[str], log: Path, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stopper(process: subprocess.Popen[bytes]) -> Callable[[], None]:
    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait(5)
    return stop


def _backend(work: Path, name: str, model: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    process = _popen([sys.executable, str(HERE / "_peers_backend.py"), str(port), model],
                     work / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30)
    return url, process


# -- the systems ---------------------------------------------------------------------------------


def start_direct(work: Path) -> Started:
    url, process = _backend(work, "backend", "fake")
    # The backend is the floor, not a system under test: its CPU is reported but not compared.
    return Started(url, "fake", [process.pid], [_stopper(process)])


def start_vllm_router(work: Path) -> Started:
    binary = PEERS_VENV / "bin" / "vllm-router"
    if not binary.exists():
        raise FileNotFoundError(f"not installed (bench/peers.py --install puts it in {binary})")
    started = Started("", "fake", [])
    urls = []
    for name in ("prefill", "decode"):
        url, process = _backend(work, f"backend-{name}", "fake")
        started.stops.append(_stopper(process))
        urls.append(url)
    port = free_port()
    router = _popen([str(binary), "--host", "127.0.0.1", "--port", str(port),
                     "--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1],
                     "--policy", "round_robin"], work / "vllm-router.log")
    started.stops.append(_stopper(router))
    started.pids = [router.pid]
    started.base_url = f"http://127.0.0.1:{port}"
    wait_http(started.base_url + "/health", 60)
    return started


def _dynamo_model_folder(work: Path) -> Path:
    """A local HF folder (config + tokenizer) for the mockers: the bundled test tokenizer."""
    from_env = os.environ.get("PEERS_DYNAMO_MODEL_PATH", "")
    if from_env:
        return Path(from_env)
    candidate = PEERS_DIR / "model"
    if not (candidate / "config.json").exists():
        # The mockers read only the config and the tokenizer: pdserve's own tiny Llama folder
        # (random weights, a locally trained tokenizer; needs torch and transformers) will do.
        try:
            from pdserve.worker.engines.vllm.model_folders import build_tiny_llama

            build_tiny_llama(candidate)
        except (ImportError, PdserveError) as exc:
            raise FileNotFoundError(
                f"no model folder for Dynamo's mockers at {candidate} (config.json + tokenizer; "
                f"or set PEERS_DYNAMO_MODEL_PATH), and none could be built: {exc}") from None
    return candidate


def start_dynamo(work: Path) -> Started:
    python = PEERS_VENV / "bin" / "python"
    if not python.exists() or not (PEERS_DIR / "dynamo.installed").exists():
        raise FileNotFoundError("not installed (bench/peers.py --install)")
    if shutil.which("ip") is None:
        raise FileNotFoundError("needs `ip netns` (iproute2) for a loopback-only namespace")
    model_path = _dynamo_model_folder(work)
    subprocess.run(["ip", "netns", "add", DYNAMO_NETNS], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "exec", DYNAMO_NETNS, "ip", "link", "set", "lo", "up"],
                   check=True)
    kv_dir = work / "dynamo-kv"
    kv_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv_dir),
           "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
           "DYN_HTTP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1"}
    netns = ["ip", "netns", "exec", DYNAMO_NETNS]
    port = free_port()
    started = Started("", "mock", [], note="")
    started.stops.append(lambda: subprocess.run(["ip", "netns", "del", DYNAMO_NETNS],
                                                capture_output=True, check=False))
    commands = [
        ("frontend", ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                      str(port), "--router-mode", "round-robin"]),
        *[(f"mocker-{mode}", ["-m", "dynamo.mocker", "--model-path", str(model_path),
                              "--model-name", "mock", "--speedup-ratio", "100000",
                              "--disaggregation-mode", mode]) for mode in ("prefill", "decode")],
    ]
    for name, argv in commands:
        process = _popen([*netns, str(python), *argv], work / f"dynamo-{name}.log", env)
        started.stops.append(_stopper(process))
        started.pids.append(process.pid)
    started.base_url = f"http://127.0.0.1:{port}"
    started.netns = DYNAMO_NETNS  # its load generator runs in the namespace too
    wait_http(started.base_url + "/v1/models", 120, netns=DYNAMO_NETNS)
    return started


def start_pdserve_memory(work: Path) -> Started:
    argv = [sys.executable, "-m", "pdserve", "up", "--grpc-port", "0", "--http-port", "0",
            "--speedup", "1e9", "--num-prefill", "1", "--num-decode", "1", "--log-level",
            "WARNING", "--local-prefill-threshold-tokens", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.setdefault("PYTHONPATH", str(ROOT / "services"))  # a caller's choice of code wins
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    assert process.stdout is not None
    url = ""
    deadline = time.monotonic() + 90
    for line in process.stdout:
        if line.startswith("http "):
            url = line.split()[1]
        if line.startswith("ready") or time.monotonic() > deadline:
            break
    if not url:
        process.kill()
        raise RuntimeError("pdserve up did not print its HTTP address")
    # Keep reading its output so a full pipe never blocks it.
    import threading
    threading.Thread(target=lambda: [None for _ in process.stdout or []], daemon=True).start()

    def stop() -> None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
    wait_model(url, "llama-3.1-8b")
    return Started(url, "llama-3.1-8b", [process.pid], [stop])


def start_pdserve_redis(work: Path, worker_args: tuple[str, ...] = WORKER_ARGS,
                        extra_env: dict[str, str] | None = None) -> Started:
    """Every service its own process on a private Redis and PostgreSQL."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from e2e.conftest import ServiceProcess, run_cli
    from e2e.faults import MODEL, build_stack
    from helpers.private_postgres import PrivatePostgres
    from helpers.private_redis import PrivateRedis

    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    started = Started("", MODEL, [])
    (work / "redis").mkdir()
    redis = PrivateRedis(work / "redis")
    redis.start()
    started.stops.append(redis.stop)
    pg_dir = work / "postgres"
    pg_dir.mkdir()
    pg_dir.chmod(0o755)
    postgres = PrivatePostgres(pg_dir)
    postgres.start()
    started.stops.append(postgres.stop)
    result = run_cli(["db", "upgrade", "--database-url", postgres.url])
    if result.returncode != 0:
        raise RuntimeError(f"pdserve db upgrade failed: {result.stderr[-500:]}")
    processes: list[ServiceProcess] = []
    started.stops.append(lambda: [p.stop() for p in reversed(processes)])
    stack = build_stack(processes, redis.url, postgres.url, num_prefill=1, num_decode=1,
                        router_args=("--http-port", "0", "--local-prefill-threshold-tokens", "0"),
                        worker_args=worker_args,
                        extra_env={"PDSERVE_LOG_LEVEL": "WARNING", **(extra_env or {})})
    router = stack.routers[0]
    if not router.http_url:
        raise RuntimeError("the router did not print its HTTP address")
    started.base_url = router.http_url
    started.grpc_address = router.grpc_address
    started.pool_address = stack.pool_address("decode")
    wait_model(started.base_url, MODEL)
    postmaster = int((pg_dir / "data" / "postmaster.pid").read_text().split()[0])
    redis_process = redis._process  # noqa: SLF001 - its pid, for the CPU count
    started.parts = {p.name: [p.pid] for p in processes}
    started.parts["postgres"] = [postmaster]
    if redis_process is not None:
        started.parts["redis"] = [redis_process.pid]
    started.pids = [pid for pids in started.parts.values() for pid in pids]
    scale = "" if "--kv-scale" in worker_args else ", the sim engine's default KV payload scale"
    started.note = (f"pdserve sim workers: {' '.join(worker_args)}{scale}; every request "
                    "disaggregated (local prefill threshold 0)")
    return started


def _sim_kv_shape(model: str) -> tuple[int, int]:
    """(layers, KV bytes of one block in one layer) as the sim engine moves them at its default
    scale (its own arithmetic on the catalog, without building an engine and its KV buffers)."""
    from pdserve.perf.catalog import get_gpu, get_model
    from pdserve.perf.kv_budget import CapacityConfig, capacity_report
    from pdserve.worker.engines.sim import SimConfig

    sim = SimConfig(model=model)
    card = get_model(model)
    report = capacity_report(card, get_gpu(sim.gpu), CapacityConfig(
        tp_size=sim.tp_size, block_size_tokens=sim.block_size_tokens,
        gpu_memory_utilization=sim.gpu_memory_utilization))
    block_nbytes = max(16, int(report.block_bytes // card.num_layers * sim.kv_scale) // 16 * 16)
    return card.num_layers, block_nbytes


def _wait_ready(log: Path, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and "ready" in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            raise RuntimeError(f"{log.stem} exited: {log.read_text(errors='replace')[-500:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{log.stem} not ready after {timeout_s:.0f} s")


def start_floor(work: Path) -> Started:
    """The floor of pdserve's topology (``bench/_path_floor.py``): its four processes on a
    private Redis, each doing only its hop's transport work."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from e2e.faults import MODEL
    from helpers.private_redis import PrivateRedis

    work.mkdir(parents=True, exist_ok=True)
    started = Started("", MODEL, [])
    (work / "redis").mkdir()
    redis = PrivateRedis(work / "redis")
    redis.start()
    started.stops.append(redis.stop)
    ports = [free_port() for _ in range(5)]
    num_layers, block_nbytes = _sim_kv_shape(MODEL)
    common = ["--redis-url", redis.url, "--ports", ",".join(map(str, ports)),
              "--block-nbytes", str(block_nbytes), "--num-layers", str(num_layers),
              "--model", MODEL]
    for role in ("coordinator", "decode", "prefill", "router"):
        log = work / f"floor-{role}.log"
        process = _popen([sys.executable, str(HERE / "_path_floor.py"), role, *common], log)
        started.stops.append(_stopper(process))
        _wait_ready(log, process)
        started.parts[role] = [process.pid]
    if redis._process is not None:  # noqa: SLF001 - its pid, for the CPU count
        started.parts["redis"] = [redis._process.pid]  # noqa: SLF001
    started.pids = [pid for pids in started.parts.values() for pid in pids]
    started.base_url = f"http://127.0.0.1:{ports[4]}"
    started.store_url = redis.url
    wait_http(started.base_url + "/health", 30)
    return started


# -- installing the peers ------------------------------------------------------------------------


def install_peers() -> None:
    """vllm-router and Dynamo (frontend and mocker) into ``bench/.peers/venv``."""
    PEERS_DIR.mkdir(exist_ok=True)
    if not (PEERS_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, VLLM_ROUTER], check=True)
    # The plain Dynamo install fetches from an unreachable host: no deps, then its runtime's.
    subprocess.run([*pip, "--no-deps", *DYNAMO], check=True)
    subprocess.run([*pip, *DYNAMO_DEPS], check=True)
    (PEERS_DIR / "dynamo.installed").write_text("1\n")
