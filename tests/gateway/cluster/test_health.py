"""Health checks tell a slow node from a dead one: a node whose /health answers late (a loaded machine) stays up
until HEALTH_MISSES checks in a row got no answer; one whose port refuses connections, or that says it is not ok, is
down at the first check; one answer in time resets the count."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tests.support.fakes import free_port
from gateway.metrics import Metrics
from gateway.cluster.nodes import HEALTH_MISSES, NodePool
from kv_bridge.config.nodes import NodeConfig


class SlowHealth:
    """A /health that answers after `delay` seconds, or 503 while `status` is 503."""

    def __init__(self) -> None:
        self.delay, self.status = 0.0, 200
        self.port = free_port()

    async def start(self) -> web.AppRunner:
        async def health(_: web.Request) -> web.Response:
            await asyncio.sleep(self.delay)
            return web.json_response({"status": "ok" if self.status == 200 else "loading", "role": "prefill"},
                                     status=self.status)

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


async def test_a_slow_node_stays_up_until_it_misses_several_checks_in_a_row():
    node = SlowHealth()
    runner = await node.start()
    pool = NodePool([NodeConfig(name="p", role="prefill", port=node.port)], Metrics(), health_interval_s=0.5)
    state = pool.nodes["p"]
    try:
        async with aiohttp.ClientSession() as session:
            await pool.check(session, state)
            assert state.up
            node.delay = pool.timeout + 0.3  # busy, not dead: answers, but late
            for _ in range(HEALTH_MISSES - 1):
                await pool.check(session, state)
                assert state.up, state.reason
            node.delay = 0.0  # one answer in time starts the count again
            await pool.check(session, state)
            node.delay = pool.timeout + 0.3
            for _ in range(HEALTH_MISSES - 1):
                await pool.check(session, state)
            assert state.up
            await pool.check(session, state)
            assert not state.up and f"{HEALTH_MISSES} times in a row" in state.reason
            node.delay = 0.0
            await pool.check(session, state)
            assert state.up and state.missed == 0
            node.status = 503  # says it is not ready: down at once
            await pool.check(session, state)
            assert not state.up and "503" in state.reason
    finally:
        await runner.cleanup()


async def test_a_refused_connection_is_down_at_the_first_check():
    node = SlowHealth()
    runner = await node.start()
    pool = NodePool([NodeConfig(name="p", role="prefill", port=node.port)], Metrics(), health_interval_s=0.5)
    state = pool.nodes["p"]
    async with aiohttp.ClientSession() as session:
        await pool.check(session, state)
        assert state.up
        await runner.cleanup()  # the process is gone: its port refuses
        await pool.check(session, state)
        assert not state.up and "ClientConnectorError" in state.reason
