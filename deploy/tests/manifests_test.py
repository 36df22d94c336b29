"""The Kubernetes manifests (deploy/kubernetes/) are what a cluster and tandem's servers accept:
every resource validates against the Kubernetes API's schemas (kubernetes-validate, strict: no
unknown field), the kustomization lists every file and names every image; each container's
arguments parse with its server's own command line into a valid configuration; Services select
the pods they front and their ports are ports the containers declare; the probes ask the ports
the servers listen on; the router finds the decode and prefill Services it is pointed at."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from decode.server import DecodeServerConfig
from decode.server import cli_parser as decode_parser
from prefill.server import PrefillServerConfig
from prefill.server import cli_parser as prefill_parser
from router.server import cli_parser as router_parser
from router.server import config_of

BASE = Path("deploy/kubernetes")
KUBERNETES_VERSION = "1.33.0"  # the oldest release still supported upstream (Dec 2026: 1.33-1.35)
POD_IP = "10.1.2.3"  # what $(POD_IP) expands to in a pod
# The pods' model folder, here the bundled model (Bazel data: //tools:smollm2).
MODEL = {"/models/model": "tools/smollm2-135m-instruct"}


def _documents() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


DOCS = _documents()


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def _container(name: str) -> dict:
    [container] = _by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"]
    return container


def _args(name: str) -> list[str]:
    """The container's arguments as its server sees them in a pod (its IP, a model folder)."""
    args = [a.replace("$(POD_IP)", POD_IP) for a in _container(name)["args"]]
    for folder, here in MODEL.items():
        args = [a.replace(f"={folder}", f"={here}") for a in args]
    return args


@pytest.mark.parametrize("doc", DOCS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCS])
def test_every_resource_validates_against_the_api_schemas(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_file_and_names_every_image():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    images = {i["name"] for i in kustomization["images"]}
    used = {_container(name)["image"] for name in _by_kind("Deployment")}
    assert images == used == {"tandem-router", "tandem-prefill", "tandem-decode"}


def test_each_containers_arguments_are_its_servers():
    decode = decode_parser().parse_args(_args("tandem-decode"))
    DecodeServerConfig.from_cli_args(decode)
    assert (decode.host, decode.grpc_port) == (POD_IP, 50051)
    prefill = prefill_parser().parse_args(_args("tandem-prefill"))
    PrefillServerConfig.from_cli_args(prefill)
    assert (prefill.host, prefill.port) == (POD_IP, 8100)
    router = config_of(router_parser().parse_args(_args("tandem-router")))
    assert router.port == 8000


def test_services_select_their_pods_on_ports_the_containers_declare():
    deployments = _by_kind("Deployment")
    for service in _by_kind("Service").values():
        selector = service["spec"]["selector"]
        [target] = [
            d for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        [container] = target["spec"]["template"]["spec"]["containers"]
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in declared
            assert port["port"] == declared[port["targetPort"]]
    for budget in _by_kind("PodDisruptionBudget").values():
        labels = budget["spec"]["selector"]["matchLabels"]
        assert any(
            labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments.values()
        )


def test_probes_ask_the_ports_the_servers_listen_on():
    decode = _container("tandem-decode")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert decode[probe]["grpc"]["port"] == 50051  # grpc.health.v1 (rpc/health.py)
    for name in ("tandem-prefill", "tandem-router"):
        container = _container(name)
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # A drain must end before the kubelet's SIGKILL.
    for name, parser in (("tandem-decode", decode_parser), ("tandem-prefill", prefill_parser)):
        spec = _by_kind("Deployment")[name]["spec"]["template"]["spec"]
        drain = parser().parse_args(_args(name)).drain_grace_s
        assert spec["terminationGracePeriodSeconds"] > drain, name


def test_the_router_finds_the_decode_and_prefill_services():
    router = config_of(router_parser().parse_args(_args("tandem-router")))
    services = _by_kind("Service")
    for address in (*router.decode_services, *router.prefill_services):
        host, port = address.removeprefix("http://").rsplit(":", 1)
        assert services[host]["spec"]["clusterIP"] == "None"  # headless: one address per pod
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
