"""Instances that come and go: the router's /admin/instances, behind the API key as /v1/* is.

    GET    /admin/instances   {"prefill": {url: "up"|"down"}, "decode": {address: ...}}
    POST   /admin/instances   {"role": "decode", "address": "10.0.0.7:50051"}
    POST   /admin/instances   {"role": "prefill", "address": "http://10.0.0.8:8100"}
    DELETE /admin/instances   {"role": ..., "address": ...}

A registered instance is probed at once (a decode server's Stats, a prefill's /health) and takes
requests once it has answered; one that does not answer is kept, marked down, and probed with
the others until it does (POST answers 201 either way, saying which). Removing an instance stops
new requests going to it; those it runs finish there. DELETE answers once no request is on its
way to the instance any more (`settled`; false if one still was after SETTLE_TIMEOUT_S): an
instance that deregisters itself before it drains (rpc/registration.py) then refuses nothing a
router sent it. A malformed body gets 400 with OpenAI's
error body, an instance registered twice 409, an unknown one removed 404, a prefill on an
aggregated router 409.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from router import discovery
from router.errors import RequestError
from router.orchestrator import Orchestrator
from router.requests import json_object

PATH = "/admin/instances"
SETTLE_TIMEOUT_S = 30.0
"""How long a DELETE waits for the requests on their way to the instance (`settled` false
after that)."""


def add_routes(app: FastAPI, orchestrator: Orchestrator) -> None:
    admin = AdminApi(orchestrator)
    app.add_api_route(PATH, admin.instances, methods=["GET"])
    app.add_api_route(PATH, admin.register, methods=["POST"])
    app.add_api_route(PATH, admin.deregister, methods=["DELETE"])


class AdminApi:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    async def instances(self) -> dict:
        return instance_health(self.orchestrator)

    async def register(self, request: Request) -> JSONResponse:
        role, address = _instance(await request.body())
        if role == "prefill" and self.orchestrator.decode_only.aggregated:
            raise RequestError(409, "an aggregated router has no prefill instances", "role")
        if not self.orchestrator.add_instance(role, address):
            raise RequestError(409, f"{role} {address} is registered already", "address")
        await self.orchestrator.probe()
        status = instance_health(self.orchestrator)[role][address]
        body = {"role": role, "address": address, "status": status}
        return JSONResponse(body, status_code=201)

    async def deregister(self, request: Request) -> dict:
        role, address = _instance(await request.body())
        removed = self.orchestrator.remove_instance(role, address)
        if removed is None:
            raise RequestError(404, f"{role} {address} is not registered", "address")
        settled = await self.orchestrator.settle(removed, SETTLE_TIMEOUT_S)
        return {"role": role, "address": address, "status": "removed", "settled": settled}


def _instance(body: bytes) -> tuple[str, str]:
    """(role, address) of a request body; RequestError(400) naming the field otherwise."""
    fields = json_object(body)
    role, address = fields.get("role"), fields.get("address")
    if role not in ("prefill", "decode"):
        raise RequestError(400, f"role: {role!r} is not 'prefill' or 'decode'", "role")
    if not isinstance(address, str):
        raise RequestError(400, f"address: {address!r} is not a string", "address")
    try:
        discovery.instance_address(role, address)
    except ValueError as e:
        raise RequestError(400, f"address: {e}", "address") from None
    return role, address


def instance_health(orchestrator: Orchestrator) -> dict[str, dict[str, str]]:
    """Every instance by role, "up" or "down" (/admin/instances, and /health's)."""
    up = {True: "up", False: "down"}
    return {
        "prefill": {p.url: up[p.healthy] for p in orchestrator.prefills},
        "decode": {d.address: up[d.healthy] for d in orchestrator.decodes},
    }
