"""deploy/ is checked by parsing (no Docker engine here): every stage the gateway is pointed at exists,
listens on the port the gateway uses, and every command line parses with the real `omnimesh` parser."""

from pathlib import Path

import yaml

from gateway.stage_discovery import parse_dns_target
from omnimesh.cli import build_parser, parse_stage_addresses
from omnimesh.config.stage_config import STAGES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _gateway_stages(args: list[str]) -> list[tuple[str, str, int]]:
    """(stage, host, port) for every address the gateway is given; every stage is named by DNS (dns:///HOST:PORT,
    each address of HOST one replica), so that scaling a stage's service scales the stage."""
    out = []
    for stage, addrs in parse_stage_addresses(args[args.index("--stages") + 1]).items():
        for addr in addrs:
            target = parse_dns_target(addr)
            assert target is not None, f"{stage}={addr}: name the stage by DNS so that its replicas are found"
            out.append((stage, target.host, target.port))
    assert {stage for stage, _, _ in out} == set(STAGES)
    return out


def test_compose_wires_every_stage() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(STAGES) | {"gateway"} <= set(services)
    parser = build_parser()
    for name in STAGES:
        cmd = services[name]["command"]
        ns = parser.parse_args(cmd)
        assert ns.stage_name == name
        assert services[name]["environment"]["STAGE_PORT"] == str(ns.stage_port)
    gw = services["gateway"]["command"]
    parser.parse_args(gw)
    for stage, host, port in _gateway_stages(gw):
        assert host in services, f"gateway points at unknown service {host}"
        assert parser.parse_args(services[host]["command"]).stage_port == int(port)
        assert services["gateway"]["depends_on"][host]["condition"] == "service_healthy"
    for name, service in services.items():  # Docker restarts a process that dies, as `omnimesh serve` does
        assert service.get("restart") == "unless-stopped", name


def test_k8s_services_match_deployments() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "omnimesh.yaml").read_text()) if d]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert set(deployments) == set(services) == {f"omnimesh-{s}" for s in (*STAGES, "gateway")}
    parser = build_parser()
    gw_args = deployments["omnimesh-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    parser.parse_args(gw_args)
    for stage, svc_name, port in _gateway_stages(gw_args):
        svc = services[svc_name]
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
        assert svc["spec"]["clusterIP"] == "None", f"{svc_name}: headless, so its DNS name lists every pod"
        dep = deployments[svc_name]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        ns = parser.parse_args(container["args"])
        assert ns.stage_name == stage and ns.stage_port == int(port)
        assert container["readinessProbe"]["grpc"]["port"] == int(port)


def test_a_client_stays_on_one_gateway_pod() -> None:
    """Stored responses and spoken answers' audio ids live in the gateway that made them: with the gateway scaled,
    a conversation's later turns must reach the same pod (Realtime is one connection, so it always does)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "omnimesh.yaml").read_text()) if d]
    gateway = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "omnimesh-gateway")
    assert gateway["spec"]["sessionAffinity"] == "ClientIP"
    assert gateway["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] >= 3600  # an audio id's hour


def test_the_gateway_takes_its_api_key_from_the_environment() -> None:
    """Both manifests hand --api-key over as OMNIMESH_API_KEY (k8s: from an optional Secret; compose: from
    the host's environment, empty = none), never on the command line."""
    from gateway.auth import ENV_VAR

    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "omnimesh.yaml").read_text()) if d]
    gw = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "omnimesh-gateway")
    container = gw["spec"]["template"]["spec"]["containers"][0]
    (env,) = [e for e in container["env"] if e["name"] == ENV_VAR]
    assert env["valueFrom"]["secretKeyRef"]["optional"] is True and "--api-key" not in container["args"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["gateway"]
    assert compose["environment"][ENV_VAR] == "${" + ENV_VAR + ":-}" and "--api-key" not in compose["command"]


def test_dockerfile_pins_torch_before_the_project() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.index("torch==2.13.0") < text.index('pip install --no-cache-dir -c constraints.txt ".[otel]"')


def test_dockerfile_installs_the_tcmalloc_every_process_reexecutes_on() -> None:
    """`--malloc auto` looks the library up by name (omnimesh/allocator.py): the image must have it."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert "apt-get install -y --no-install-recommends libtcmalloc-minimal4" in text


def test_compose_stages_share_one_ipc_namespace() -> None:
    """Shared-memory hand-off needs one /dev/shm: every container joins the encoder's IPC namespace, and it
    has room for every stage's default arena."""
    from omnimesh.config.stage_config import StageConfig, parse_bytes

    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert services["encoder"]["ipc"] == "shareable"
    for name in (*STAGES, "gateway"):
        if name != "encoder":
            assert services[name]["ipc"] == "service:encoder", name
    assert parse_bytes(services["encoder"]["shm_size"].upper().replace("GB", "GiB")) >= len(STAGES) * StageConfig().shm_arena_size


def test_dockerfile_builds_the_cpu_kernels_with_a_compiler_it_installs() -> None:
    """The fused CPU kernels build with g++ (omnimesh/kernels/cpu_kernels.py); without it every stage would run
    eager PyTorch ops and warn."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert "libtcmalloc-minimal4 g++" in text
    assert text.index('pip install --no-cache-dir -c constraints.txt ".[otel]"') < text.index(
        "RUN python -m omnimesh.kernels.cpu_kernels")


def test_the_kernel_source_ships_in_the_package() -> None:
    import tomllib

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    assert "csrc/*.cpp" in project["tool"]["setuptools"]["package-data"]["omnimesh"]
    assert any(dep.startswith("ninja") for dep in project["project"]["dependencies"])


def test_constraints_pin_every_dependency_within_the_projects_ranges() -> None:
    """constraints.txt (what setup.sh and the image install under) names one exact version of every dependency
    and extra of pyproject.toml but torch (pinned on its own), each inside the range pyproject.toml allows, and
    the Dockerfile copies it before installing."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    root = DEPLOY.parent
    pins = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", line
            pins[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pins
            continue
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt's {req.name}=={pins[name]} " \
                                                                     f"is outside pyproject.toml's {req.specifier}"
    docker = (DEPLOY / "Dockerfile").read_text()
    assert docker.index("constraints.txt ./") < docker.index("-c constraints.txt")


def test_a_stage_loading_its_weights_is_not_killed_before_its_start_timeout() -> None:
    """A real checkpoint takes minutes to load: Kubernetes gives each stage a startup probe that allows as long
    as omnimesh's --stage-start-timeout (liveness counts only after it), and compose's health check a start
    period as long (failures in it do not count), instead of a liveness probe that fired after 60-90 s."""
    from omnimesh.config.serve_args import ServeArgs

    allowed = ServeArgs().stage_start_timeout
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "omnimesh.yaml").read_text()) if d]
    stages = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
              if c["name"] in STAGES]
    assert sorted(c["name"] for c in stages) == sorted(STAGES)
    for c in stages:
        startup, live = c["startupProbe"], c["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= allowed, c["name"]
        assert startup["grpc"] == live["grpc"] == c["readinessProbe"]["grpc"], c["name"]
        assert "initialDelaySeconds" not in live, c["name"]
    health = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["x-stage"]["healthcheck"]
    assert health["start_period"] == f"{allowed:.0f}s"
