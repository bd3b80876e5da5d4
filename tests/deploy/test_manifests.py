"""`deploy/`: every manifest parses as YAML, each kind has the fields it needs and its
references resolve (selectors, ports, volumes, the pool's pods), each container's command line
is accepted by the program's own argument parser (a flag that drifted fails here), and the
Dockerfile installs the package with the README's set-up command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from toppings.scheduler.cli import parse_args as scheduler_args
from toppings.server.cli_args import build_parser, parse_configs

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def serve_args(args: list[str]):
    """toppings-serve's parse and validation (exit 2 on an unknown or bad flag)."""
    return parse_configs(build_parser().parse_args(args))


PARSERS = {"toppings-serve": serve_args, "toppings-scheduler": scheduler_args}


def documents() -> list[dict]:
    docs = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]
    return [doc for doc in docs if doc is not None]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def containers() -> list[tuple[dict, dict]]:
    """(deployment, container) for every container of every Deployment."""
    return [
        (d, c) for d in by_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]
    ]


def serve_container() -> tuple[dict, dict]:
    ((deployment, container),) = [(d, c) for d, c in containers()
                                  if c["command"] == ["toppings-serve"]]  # fmt: skip
    return deployment, container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_manifests_hold_every_kind_the_deployment_needs():
    assert MANIFESTS, "deploy/ has no manifests"
    kinds = [doc["kind"] for doc in documents()]
    for kind in ("Deployment", "Service", "InferencePool", "HTTPRoute", "PersistentVolumeClaim"):
        assert kind in kinds, kind
    programs = {c["command"][0] for _, c in containers()}
    assert programs == set(PARSERS)


def test_every_document_has_its_required_fields():
    for doc in documents():
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc["metadata"]["name"], doc
        assert "spec" in doc, doc["metadata"]["name"]
    for pvc in by_kind("PersistentVolumeClaim"):
        assert pvc["spec"]["accessModes"] and pvc["spec"]["resources"]["requests"]["storage"]


@pytest.mark.parametrize("deployment", by_kind("Deployment"), ids=lambda d: d["metadata"]["name"])
def test_deployment(deployment):
    assert deployment["apiVersion"] == "apps/v1"
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    pod = spec["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
              if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims <= {pvc["metadata"]["name"] for pvc in by_kind("PersistentVolumeClaim")}
    for container in pod["containers"]:
        assert container["name"] and container["image"]
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(flag(container["args"], "--port")) in ports.values()
        assert flag(container["args"], "--host") == "0.0.0.0"  # reachable from other pods
        for probe in ("readinessProbe", "livenessProbe"):
            action = container[probe].get("httpGet") or container[probe]["tcpSocket"]
            assert action["port"] in ports or action["port"] in ports.values()
        # Guaranteed QoS, whole CPUs: what the static CPU manager pins.
        resources = container["resources"]
        assert resources["requests"] == resources["limits"]
        assert str(resources["limits"]["cpu"]).isdigit() and resources["limits"]["memory"]


@pytest.mark.parametrize("pair", containers(), ids=lambda p: p[1]["name"])
def test_container_command_lines_parse(pair):
    _, container = pair
    (program,) = container["command"]
    PARSERS[program](container["args"])  # an unknown or ill-typed flag exits here


def test_serve_probes_health_and_mounts_its_adapter_store():
    deployment, container = serve_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    serve, config, options = serve_args(container["args"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_of(path: str) -> dict:
        mount = next(m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/"))
        return volumes[mounts[mount]]

    assert "persistentVolumeClaim" in volume_of(options.adapter_store)
    for root in serve.allowed_lora_roots:
        assert "persistentVolumeClaim" in volume_of(root)
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"  # the CPU workers' shm
    cpus = int(container["resources"]["limits"]["cpu"])
    assert config.num_cpu_workers < cpus and not config.cpu_cores  # pinned inside the cpuset


def test_services_select_pods_and_ports_that_exist():
    deployments = {d["metadata"]["name"]: d for d in by_kind("Deployment")}
    for service in by_kind("Service"):
        selector = service["spec"]["selector"]
        matching = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matching) == 1, service["metadata"]["name"]
        (container,) = matching[0]["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names


def test_the_pool_selects_the_servers_and_the_route_the_pool():
    (pool,) = by_kind("InferencePool")
    deployment, container = serve_container()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = int(flag(container["args"], "--port"))
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    assert pool["spec"]["endpointPickerRef"]["name"]
    pools = {pool["metadata"]["name"]}
    for route in by_kind("HTTPRoute"):
        refs = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
        assert refs and all(r["kind"] == "InferencePool" and r["name"] in pools for r in refs)
        assert route["spec"]["parentRefs"]


def install_lines(text: str) -> list[str]:
    return [" ".join(shlex.split(m)) for m in re.findall(r"python3 -m pip install [^\n]+", text)]


def test_the_dockerfile_installs_as_the_readme_does():
    readme = install_lines((ROOT / "README.md").read_text())
    setup = readme[0]  # the Quick start's set-up command
    assert "-e" in setup.split()
    docker = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
              if line.startswith("RUN python3 -m pip install")]  # fmt: skip
    assert [" ".join(shlex.split(line.removeprefix("RUN "))) for line in docker] == [setup]


def test_the_server_names_its_kv_events_endpoints_and_exposes_their_ports():
    _, container = serve_container()
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for option, port_name in (("--kv-events-endpoint", "kv-events"),
                              ("--kv-events-replay-endpoint", "kv-replay")):  # fmt: skip
        endpoint = flag(args, option)
        assert endpoint.startswith("tcp://*:")  # reached at the pod's IP (feeds.connect_address)
        assert int(endpoint.rsplit(":", 1)[1]) == ports[port_name]
    (scheduler,) = [c for _, c in containers() if c["command"] == ["toppings-scheduler"]]
    assert flag(scheduler["args"], "--policy") == "prefix-aware"
