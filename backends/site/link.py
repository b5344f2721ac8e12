"""A site's KV link on one machine: a relay on a decode node's kv_advertise_host:port that forwards to its
kv_host:kv_port at `[site] link_bytes_per_s` (prefill -> decode; replies unshaped), and can be cut and restored.

`python -m backends.site.link --node mac-0 --config examples/site-local.toml`; backends/site/launch.py starts one per
decode node. Control (HTTP on kv_advertise_host:[site] control_port): GET /health, POST /cut, POST /restore,
POST /rate?bytes_per_s=N.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from aiohttp import web

from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings, load_config

log = logging.getLogger("disagg.site_link")
CHUNK = 32 << 10  # a frame's last chunk crosses unpaced: 32 KiB of a 1 MB frame is 3%


class Pacer:
    """Paces bytes at `rate` on a virtual clock, shared by every connection of one link as a NIC's rate is. Each
    chunk is due when the ones before it would have crossed; a timer that wakes late (asyncio sleeps are ~1 ms
    coarse) is made up by the next chunks, and a link idle for IDLE_S starts afresh: no burst saved up between
    frames, so a frame crosses at the rate from its first chunk on."""

    IDLE_S = 0.005

    def __init__(self, rate: float | None):
        self.rate = rate
        self.due = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        if now - self.due > self.IDLE_S:
            self.due = now
        due, self.due = self.due, self.due + n / self.rate
        if due > now:
            await asyncio.sleep(due - now)


class Link:
    def __init__(self, node: NodeConfig, rate: float | None):
        self.node = node
        self.pacer = Pacer(rate)
        self.up = True
        self.bytes = 0
        self.cuts = 0
        self.conns: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:  # a cut link: the connection dies at once, as a prefill node's connect would time out
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.node.kv_host or self.node.host, self.node.kv_port)
        except OSError as e:
            log.warning("link %s: cannot reach the KV receiver: %s", self.node.name, e)
            writer.transport.abort()
            return
        self.conns.update((writer, up_w))
        try:
            await asyncio.gather(self._pump(reader, up_w, shaped=True), self._pump(up_r, writer, shaped=False))
        finally:
            for w in (writer, up_w):
                self.conns.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shaped: bool) -> None:
        try:
            while data := await reader.read(CHUNK):  # small chunks: a frame crosses at the rate, not in one burst
                if shaped:
                    await self.pacer.take(len(data))
                    self.bytes += len(data)
                if writer.transport.is_closing():
                    return
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.up:
                writer.transport.abort()

    def cut(self) -> int:
        """Drop every live connection (both ends see a reset) and refuse new ones until restore()."""
        self.up, self.cuts = False, self.cuts + 1
        n = len(self.conns) // 2  # a connection is two writers: the prefill side and the receiver side
        for w in list(self.conns):
            w.transport.abort()
        self.conns.clear()
        log.warning("link %s: cut (%d connections dropped)", self.node.name, n)
        return n

    def state(self) -> dict:
        return {"node": self.node.name, "up": self.up, "rate_bytes_per_s": self.pacer.rate, "bytes": self.bytes,
                "connections": len(self.conns) // 2, "cuts": self.cuts}


def control_app(link: Link) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response(link.state())

    async def cut(request: web.Request) -> web.Response:
        dropped = link.cut()
        return web.json_response({**link.state(), "dropped": dropped})

    async def restore(request: web.Request) -> web.Response:
        link.up = True
        log.warning("link %s: restored", link.node.name)
        return web.json_response(link.state())

    async def rate(request: web.Request) -> web.Response:
        """?bytes_per_s=N sets the link's rate until the next call (a test slows a transfer down to cut it)."""
        try:
            value = float(request.query["bytes_per_s"])
            if value <= 0:
                raise ValueError
        except (KeyError, ValueError):
            return web.json_response({"error": "bytes_per_s must be a positive number"}, status=400)
        link.pacer.rate = value
        return web.json_response(link.state())

    app = web.Application()
    app.router.add_post("/rate", rate)
    app.router.add_get("/health", health)
    app.router.add_post("/cut", cut)
    app.router.add_post("/restore", restore)
    return app


def link_node(settings: Settings, name: str) -> NodeConfig:
    node = settings.node(name)
    if node.role != "decode" or not node.kv_advertise_host:
        raise SystemExit(f"site_link: {name!r} is not a decode node with a kv_advertise_host; a link relays to one")
    return node


async def run(settings: Settings, node: NodeConfig) -> None:
    link = Link(node, settings.site.link_bytes_per_s)
    host, port = node.kv_target["host"], node.kv_target["port"]
    server = await asyncio.start_server(link.handle, host, port, reuse_address=True)
    runner = web.AppRunner(control_app(link), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, settings.site.control_port).start()
    log.warning("link %s: %s:%d -> %s:%d at %s bytes/s, control on port %d", node.name, host, port,
                node.kv_host or node.host, node.kv_port, settings.site.link_bytes_per_s or "unshaped",
                settings.site.control_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="site_link", description=__doc__)
    p.add_argument("--node", required=True, help="the decode node whose KV link this is")
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = load_config(args.config)
    try:
        asyncio.run(run(settings, link_node(settings, args.node)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
