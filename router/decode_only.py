"""Requests a decode server prefills itself (GenerateRequest.local_prefill), with no prefill
instance in their path: every request in aggregated mode (`--aggregated`: the baseline that
disaggregation is measured against), and, disaggregated, each request while no prefill instance
is healthy: the decode-only fallback (on unless `--no-decode-only-fallback`: then such a
request fails with 503, as it would have).

The fallback is never silent: every request it serves is counted (the router's
tandem_router_decode_only_fallback_total) and each change between disaggregated serving and the
fallback is logged once. A prefill instance probed healthy again (Orchestrator.probe) takes the
requests back.
"""

from __future__ import annotations

import logging

log = logging.getLogger("router.decode_only")


class DecodeOnly:
    def __init__(self, aggregated: bool = False, fallback: bool = True) -> None:
        self.aggregated = aggregated
        self.fallback = fallback
        self.fallback_requests = 0
        """Requests the fallback served (or began to) since start."""
        self._falling_back = False

    @property
    def mode(self) -> str:
        """How requests are served, as the last one saw it: "aggregated", "disaggregated" or
        "decode-only fallback"."""
        if self.aggregated:
            return "aggregated"
        return "decode-only fallback" if self._falling_back else "disaggregated"

    def skip_prefill(self, any_prefill_healthy: bool) -> bool:
        """Whether the request at hand goes straight to its decode server (counted when that
        is the fallback). Asked before a request is placed, and again after its prefill failed
        (with the instances' health as that failure left it)."""
        if self.aggregated:
            return True
        falling_back = self.fallback and not any_prefill_healthy
        if falling_back != self._falling_back:
            self._falling_back = falling_back
            if falling_back:
                log.warning(
                    "no prefill instance is healthy: requests are prefilled by the decode "
                    "servers (decode-only fallback) until one is back"
                )
            else:
                log.warning(
                    "a prefill instance is healthy again: requests are disaggregated again "
                    "(%d served by the decode-only fallback so far)",
                    self.fallback_requests,
                )
        self.fallback_requests += falling_back
        return falling_back
