"""The sender tells the prefill node which streams opened (kv_bridge/send_status.py): a real receiver's ACK says
opened; a decode port nobody listens on, or a link that drops the connection before the HEADER crossed, says why it
never opened; nothing told within the bound is no verdict (the decode node judges the stream then)."""

from __future__ import annotations

import asyncio
import socket
import threading

from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.send_status import StatusListener, StatusSink
from kv_bridge.sender import KVSender
from tests.support.kv_sender import SPEC, header
from tests.support.stack import free_port


def _dropping_link() -> tuple[socket.socket, threading.Thread]:
    """A link that accepts, reads the first bytes of the HEADER and drops the connection (a cut before the ACK)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        conn.recv(16)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        conn.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv, t


def test_each_stream_says_whether_it_opened():
    async def go():
        status = StatusListener()
        await status.start()
        sender = KVSender(max_bytes=1 << 20, connect_timeout_s=2.0, status=StatusSink(status.path))
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        link, t = _dropping_link()
        try:
            rx.expect("ok", 64, SPEC)
            sender.open(header("ok", 64), "127.0.0.1", port)
            sender.open(header("nobody", 64), "127.0.0.1", free_port())
            sender.open(header("cut", 64), "127.0.0.1", link.getsockname()[1])
            return [await status.failure(tid, 10.0) for tid in ("ok", "nobody", "cut")]
        finally:
            sender.shutdown()
            link.close()
            await rx.stop()
            status.close()

    ok, nobody, cut = asyncio.run(go())
    assert ok is None
    assert nobody is not None and "cannot open KV stream" in nobody and "refused" in nobody.lower()
    assert cut is not None and "cannot open KV stream" in cut


def test_nothing_told_is_no_verdict_and_a_late_word_is_kept():
    async def go():
        status = StatusListener()
        await status.start()
        try:
            silent = await status.failure("queued", 0.2)  # its stream still waits behind another transfer
            StatusSink(status.path)("late", "cannot open KV stream to x:1: refused")
            StatusSink(status.path)("late", None)  # a second rank's word does not overwrite the first
            await asyncio.sleep(0.1)
            return silent, await status.failure("late", 1.0)
        finally:
            status.close()

    silent, late = asyncio.run(go())
    assert silent is None and late == "cannot open KV stream to x:1: refused"


def test_a_sink_whose_node_is_gone_does_not_raise(tmp_path):
    StatusSink(str(tmp_path / "gone.sock"))("t", None)
