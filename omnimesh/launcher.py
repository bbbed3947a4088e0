"""MeshLauncher: `omnimesh serve` — every stage and the gateway as child processes of one command.

Data flow: pick ports -> start the stage processes (`omnimesh stage NAME ...`; a stage with `num_replicas`
N in --stage-overrides runs as N processes, `NAME#0` ... `NAME#N-1`, each on its own port and its own slice
of the stage's `devices`, all handed to the gateway, which balances requests over them) and, at once, the
gateway process pointed at them (with the HTTP front flags: CORS, TLS, logs): its imports, tokenizer and
processor load while the stages load their weights, and it waits for them itself -> wait until each stage
answers gRPC health, then the gateway's /health (bounded by --stage-start-timeout; a child that exits
during start-up is reported by name with its exit code) -> print where it listens
-> watch the children: a stage that dies is reported by name (the gateway answers 503 for requests
that need it, and its /health says which stage is down) and started again on its port after a backoff
(1, 2, 4 ... 30 s), at most `--stage-restarts` times in 10 minutes; one more exit, or the gateway dying,
ends the mesh with code 1, so that an outer supervisor (systemd, Kubernetes) takes over. A stage that stays
up but reports NOT_SERVING (one of its ranks died) is stopped and restarted the same way, as a Kubernetes
liveness probe would.
Ctrl-C / SIGTERM stops the gateway first (it finishes the requests in flight while the stages still
serve them), then the stages (SIGTERM, then SIGKILL after a grace period each). Children get
PR_SET_PDEATHSIG, so they die with the launcher even if it is killed outright.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omnimesh.config.serve_args import GATEWAY_FIELDS, ServeArgs, to_argv
from omnimesh.config.stage_config import STAGES
from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages, text_only_reason
from omnimesh.node_launcher import node_argv
from omnimesh.proc_utils import RESERVED_PORTS_ENV, die_with_parent, free_port
from omnimesh.server.grpc_server import listen_address

STOP_GRACE_S = 10.0
RESTART_WINDOW_S = 600.0  # --stage-restarts counts the restarts within this
MAX_RESTART_BACKOFF_S = 30.0
POLL_S = 0.5
HEALTH_EVERY_S = 5.0  # how often a running stage's gRPC health is read (NOT_SERVING: stop and restart it; ~3 ms CPU a read)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str
    argv: list[str]
    env: dict[str, str] | None = None  # extra environment (secrets stay off the command line)


@dataclass
class Restarts:
    """One stage's restart bookkeeping in `_watch`."""

    times: list[float]  # monotonic times of its restarts, the last RESTART_WINDOW_S only
    due: float | None = None  # when the pending restart runs; None: none pending
    starting: bool = False  # restarted, not yet serving
    checked: float = 0.0  # monotonic time of the last health read


class MeshLauncher:
    def __init__(self, args: ServeArgs, model_dir: Path):
        self.args = args
        self.model_dir = model_dir
        self.children: list[Child] = []
        self._stopping = False
        self._signal: int | None = None  # the signal that asked for the stop
        self._serving = False  # the mesh has served (a stop then exits 0; one during start-up 128 + the signal)

    def _spawn(self, name: str, argv: list[str], address: str, env: dict[str, str] | None = None) -> Child:
        child = Child(name, _popen(argv, env), address, argv, env)
        self.children.append(child)
        return child

    def _stage_argv(self, stage: str, port: int, replica: int = 0) -> list[str]:
        a = self.args
        argv = ["stage", stage, "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", a.dtype, "--device", a.device, "--block-size", str(a.block_size),
                "--stream-interval", str(a.stream_interval), "--audio-windows", a.audio_windows, "--malloc", a.malloc]
        if a.enforce_eager:
            argv.append("--enforce-eager")
        if a.load_format != "auto":
            argv += ["--load-format", a.load_format]
        if stage == "encoder":
            argv += ["--encoder-cache-memory", a.encoder_cache_memory]
        if a.disable_log_stats:
            argv.append("--disable-log-stats")
        if a.otlp_traces_endpoint is not None:
            argv += ["--otlp-traces-endpoint", a.otlp_traces_endpoint]
        if a.seed is not None and stage in ("thinker", "talker"):  # the stages that sample
            argv += ["--seed", str(a.seed)]
        if a.logprobs_mode != "raw_logprobs" and stage == "thinker":  # the stage that reports logprobs
            argv += ["--logprobs-mode", a.logprobs_mode]
        if a.generation_config != "auto" and stage == "thinker":  # a folder as an absolute path
            gen = a.generation_config
            argv += ["--generation-config", gen if gen == "vllm" else str(Path(gen).resolve())]
        if a.served_model_name is not None:  # the stage's metrics carry the first as model_name
            argv += ["--served-model-name", *a.served_model_name]
        if a.tokenizer is not None and stage == "thinker":  # its detokenizer, stop strings, grammars
            argv += ["--tokenizer", str(Path(a.tokenizer).resolve())]
        cfg = a.stage_configs(together=True)[stage]  # the whole mesh on this host: GPUs shared
        argv += ["-tp", str(cfg.tp), "-pp", str(cfg.pp)]
        if cfg.world_size > 1 and a.distributed_executor_backend != "mp":  # how its ranks 1..N-1 start
            argv += ["--distributed-executor-backend", a.distributed_executor_backend]
            if a.ray_address is not None:
                argv += ["--ray-address", a.ray_address]
        # the stage's own resolved settings (global flags under its --stage-overrides entry)
        own: dict[str, object] = {"max_num_seqs": cfg.max_num_seqs, "max_waiting_requests": cfg.max_waiting_requests,
                                  "gpu_memory_utilization": cfg.gpu_memory_utilization,
                                  "transport": cfg.transport, "shm_arena_size": cfg.shm_arena_size,
                                  "shm_min_tensor_size": cfg.shm_min_tensor_size, "nice": cfg.nice,
                                  "scheduling_policy": cfg.scheduling_policy,
                                  "enable_prefix_caching": cfg.enable_prefix_caching,
                                  "kv_cache_dtype": cfg.kv_cache_dtype,
                                  "enable_chunked_prefill": cfg.enable_chunked_prefill}
        for key in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory", "bulk_nice", "yield_steps",
                    "default_sampling_params"):
            if getattr(cfg, key) is not None:
                own[key] = getattr(cfg, key)
        if devices := cfg.replica_devices(replica):  # each replica on its own slice of the stage's devices
            own["devices"] = ",".join(devices)
        if cfg.pp_layer_partition is not None:
            own["pp_layer_partition"] = list(cfg.pp_layer_partition)
        if own:
            argv += ["--stage-overrides", json.dumps({stage: own})]
        return argv + node_argv(a, stage)  # a stage spread over --num-nodes hosts: its rendezvous flags

    def _gateway_argv(self, stage_addrs: dict[str, list[str]]) -> list[str]:
        a = self.args
        stages = ",".join(f"{k}={v}" for k, addrs in stage_addrs.items() for v in addrs)  # a replica: its name again
        argv = ["gateway", "--model", str(self.model_dir), "--host", a.host, "--port", str(a.port),
                "--grpc-port", str(a.grpc_port), "--stages", stages,
                "--async-chunk" if a.async_chunk else "--no-async-chunk", "--malloc", a.malloc]
        if a.tokenizer is not None:
            argv += ["--tokenizer", str(Path(a.tokenizer).resolve())]
        # every other gateway flag as given (the HTTP front's too): a flag added to GATEWAY_FIELDS reaches it
        return argv + to_argv(a, only=GATEWAY_FIELDS, skip=_GATEWAY_SET_HERE)

    def _gateway_env(self) -> dict[str, str] | None:
        """--api-key reaches the gateway in its environment, not on a command line that `ps` shows."""
        from gateway.auth import ENV_VAR

        return None if self.args.api_key is None else {ENV_VAR: self.args.api_key}

    def _gateway_probe(self) -> tuple[Callable[[], bool], str]:
        """Ready = its /health answers 200 (over TLS: not checking the certificate of our own child). Under
        mutual TLS (--ssl-cert-reqs 2) /health needs a client certificate the launcher lacks; the port then
        tells, since the gateway listens only once it has reached every stage."""
        a = self.args
        host = _client_host(a.host)
        if a.uds is not None:  # --uds: the REST API is on a Unix socket, not a port (mutual TLS: is it there yet)
            if a.ssl_cert_reqs == 2:
                return lambda: _socket_exists(a.uds), f"the Unix socket {a.uds} (mutual TLS)"
            url = f"{'https' if a.ssl_keyfile else 'http'}://localhost/health"
            return lambda: _http_ok(url, a.uds), f"GET {url} over {a.uds}"
        if a.ssl_cert_reqs == 2:
            return lambda: _port_open(host, a.port), f"a TCP connection to {host}:{a.port} (mutual TLS)"
        url = f"{'https' if a.ssl_keyfile else 'http'}://{listen_address(host, a.port)}/health"
        return lambda: _http_ok(url), f"GET {url}"

    def _wait_ready(self, child: Child, probe, what: str, deadline: float) -> None:
        """Until `probe()` holds for `child`; any child that exits meanwhile (the gateway too, while a stage
        loads) fails the start at once, by name."""
        while time.monotonic() < deadline:
            if self._stopping:
                raise KeyboardInterrupt  # Ctrl-C / SIGTERM during start-up (`_on_signal`)
            for started in self.children:
                if (code := started.proc.poll()) is not None:
                    raise RuntimeError(f"{started.name} exited with code {code} during start-up (see its log above)")
            if probe():
                return
            time.sleep(0.25)
        raise RuntimeError(f"{child.name} did not become ready within {self.args.stage_start_timeout:g}s ({what}; "
                           "--stage-start-timeout)")

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        except RuntimeError as exc:
            print(f"omnimesh: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            if self._serving:
                return 0  # a stop asked for: every request in flight was finished
            print("omnimesh: stopped during start-up (the mesh never served)", file=sys.stderr, flush=True)
            return 128 + (self._signal or signal.SIGINT)
        finally:
            self.stop()

    def _run(self) -> int:
        base = self.args.stage_base_port
        addrs: dict[str, list[str]] = {}
        stage_children: list[Child] = []
        stages = model_stages(self.model_dir)
        if stages != STAGES:  # a thinker-only or Qwen2.5-Omni checkpoint: text out only
            print(f"omnimesh: {text_only_reason(self.model_dir)}; starting the {' and '.join(stages)} stages only",
                  file=sys.stderr, flush=True)
        elif self.args.stage_configs()["talker"].num_replicas == 0:  # --stage-overrides leave speech out
            print("omnimesh: num_replicas 0 for the talker and vocoder: text out only; starting the encoder and "
                  "thinker stages only", file=sys.stderr, flush=True)
        plan = list(stage_processes(self.args, stages))
        ports: list[int] = []
        for _ in plan:
            ports.append(base + len(ports) if base else free_port(avoid=ports))
        reserved = {RESERVED_PORTS_ENV: ",".join(map(str, ports))}  # no stage's rank rendezvous takes one of them
        for (stage, replica, name), port in zip(plan, ports):
            if self._stopping:  # Ctrl-C / SIGTERM while spawning: start no more (`stop` ends those started)
                raise KeyboardInterrupt
            addrs.setdefault(stage, []).append(f"127.0.0.1:{port}")
            stage_children.append(self._spawn(name, self._stage_argv(stage, port, replica), addrs[stage][-1], reserved))
        # the gateway starts now, not once the stages serve: it waits for them itself (--stage-start-timeout)
        gw = self._spawn("gateway", self._gateway_argv(addrs), f"{self.args.host}:{self.args.port}", self._gateway_env())
        deadline = time.monotonic() + self.args.stage_start_timeout
        for child in stage_children:
            self._wait_ready(child, lambda c=child: _grpc_serving(c.address), "gRPC health", deadline)
        self._wait_ready(gw, *self._gateway_probe(), deadline)
        a = self.args
        scheme = "https" if a.ssl_keyfile else "http"
        rest = f"{scheme} over unix:{a.uds}" if a.uds else f"{scheme}://{listen_address(a.host, a.port)}"
        self._serving = True
        print(
            f"omnimesh serving {self.model_dir} — REST {rest}/v1 , "
            f"gRPC {listen_address(a.host, a.grpc_port)} , stages "
            + ", ".join(f"{c.name}@{c.address}" for c in stage_children),
            flush=True,
        )
        return self._watch()

    def _watch(self) -> int:
        """Until a signal: a stage (or the gateway) that exits is restarted on its port within --stage-restarts
        (the gateway finds its stages again; the stages never notice a new gateway); past the limit, or a
        gateway with --stage-restarts 0, the mesh stops with exit code 1."""
        state = {child.name: Restarts([]) for child in self.children}
        while not self._stopping:
            now = time.monotonic()
            for child in self.children:
                code = child.proc.poll()
                st = state[child.name]
                if code is None:
                    if child.name == "gateway":  # restarted: it waits for the stages itself, then answers /health
                        if st.starting and self._gateway_probe()[0]():
                            st.starting = False
                            print(f"omnimesh: the gateway (pid {child.proc.pid}) is serving again", file=sys.stderr,
                                  flush=True)
                    elif self.args.stage_restarts and (now - st.checked >= HEALTH_EVERY_S or st.starting):
                        st.checked = now
                        self._check_health(child, st)
                    continue
                if st.due is None:
                    if not self._schedule_restart(child, code, st, now):
                        return 1
                elif now >= st.due:
                    st.due, st.starting = None, True
                    st.times.append(now)
                    child.proc = _popen(child.argv, child.env)
                    print(f"omnimesh: {_what(child)} restarted (pid {child.proc.pid})", file=sys.stderr, flush=True)
            time.sleep(POLL_S)
        return 0

    def _check_health(self, child: Child, st: Restarts) -> None:
        status = _grpc_status(child.address)
        if st.starting:
            if status == "SERVING":
                st.starting = False
                print(f"omnimesh: stage {child.name} (pid {child.proc.pid}) is serving again", file=sys.stderr, flush=True)
        elif status == "NOT_SERVING":  # a rank died; the stage says so in its log
            print(f"omnimesh: stage {child.name} (pid {child.proc.pid}) reports NOT_SERVING (see its log above); "
                  f"stopping it", file=sys.stderr, flush=True)
            child.proc.terminate()
            try:
                child.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def _schedule_restart(self, child: Child, code: int, st: Restarts, now: float) -> bool:
        """Report a stage (or the gateway) that exited and plan its restart; False when it may not restart (stop
        the mesh)."""
        limit = self.args.stage_restarts
        st.times = [t for t in st.times if now - t < RESTART_WINDOW_S]
        said = f"omnimesh: {_what(child)} (pid {child.proc.pid}) exited with code {code}"
        if limit == 0 and child.name == "gateway":  # a stage may stay down; without a gateway nothing is served
            print(f"omnimesh: the gateway exited with code {code}; stopping the mesh (--stage-restarts 0)",
                  file=sys.stderr, flush=True)
            return False
        if limit == 0:
            st.due = float("inf")  # reported once, never restarted
            print(f"{said}; {_meanwhile(child)} (--stage-restarts 0: it is not restarted)",
                  file=sys.stderr, flush=True)
            return True
        if len(st.times) >= limit:
            print(f"{said} after {len(st.times)} restart(s) in the last {RESTART_WINDOW_S / 60:.0f} minutes "
                  f"(--stage-restarts {limit}); stopping the mesh (see the stage's log above)", file=sys.stderr, flush=True)
            return False
        delay = min(MAX_RESTART_BACKOFF_S, 2.0 ** len(st.times))
        st.due, st.starting = now + delay, False
        print(f"{said}; restarting it in {delay:.0f}s (restart {len(st.times) + 1} of at most {limit} in "
              f"{RESTART_WINDOW_S / 60:.0f} minutes); {_meanwhile(child)} until it serves again",
              file=sys.stderr, flush=True)
        return True

    def _on_signal(self, signum: int, frame: object) -> None:
        """Only a flag, which the start-up wait and the watch loop read (each within half a second): raised from
        here, a KeyboardInterrupt that lands while a child is being spawned can be swallowed there."""
        self._stopping = True
        self._signal = signum

    def stop(self) -> None:
        """The gateway first: it stops taking requests and finishes the streams in flight (within the grace
        period) while every stage still serves them; then the stages, which end their own calls."""
        self._stopping = True
        gateways = [c for c in self.children if c.name == "gateway"]
        for group in (gateways, [c for c in self.children if c.name != "gateway"]):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()


def stage_processes(args: ServeArgs, stages: tuple[str, ...] = STAGES) -> list[tuple[str, int, str]]:
    """(stage, replica, the name logs use) of every process of the model's `stages`, in start order (and port
    order under --stage-base-port): `vocoder` alone, or `vocoder#0`, `vocoder#1` with two replicas."""
    out = []
    for stage, cfg in args.stage_configs().items():
        for k in range(cfg.num_replicas if stage in stages else 0):
            out.append((stage, k, stage if cfg.num_replicas == 1 else f"{stage}#{k}"))
    return out


def _what(child: Child) -> str:
    return "the gateway" if child.name == "gateway" else f"stage {child.name}"


def _meanwhile(child: Child) -> str:
    """What a stage process being down means for requests: a replica's go to its stage's other replicas."""
    if child.name == "gateway":
        return "no request is answered"
    if "#" in child.name:
        return "the gateway sends its requests to the stage's other replicas"
    return "requests that need it fail with 503"


def _popen(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "omnimesh.cli", *argv], preexec_fn=die_with_parent,
                            env=None if env is None else {**os.environ, **env})


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _grpc_serving(address: str) -> bool:
    return _grpc_status(address) == "SERVING"


def _grpc_status(address: str) -> str:
    """The stage's overall gRPC health: SERVING, NOT_SERVING, ...; "UNREACHABLE" when it does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    except grpc.RpcError:
        return "UNREACHABLE"


def _http_ok(url: str, uds: str | None = None) -> bool:
    import httpx

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=uds, verify=False), timeout=1.0) as client:  # noqa: S501
            return client.get(url).status_code == 200  # our child, on loopback or its socket
    except httpx.HTTPError:
        return False


def _socket_exists(path: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


# the gateway flags `_gateway_argv` sets itself (the rest go as given): its address and the stages', a resolved
# tokenizer path; the API key and log config travel in the environment, away from `ps`
_GATEWAY_SET_HERE = frozenset({"model", "host", "port", "grpc_port", "async_chunk", "malloc", "tokenizer", "api_key",
                               "log_config_file"})
