"""`python -m tests.support.netns_gateway SPEC.json`: the real gateway process (gateway.app.serve, every listen address)
over a fake cluster (tests/support/fakes.py, on this network namespace's loopback), for tests that reach it from other
namespaces. SPEC holds the [gateway] and [auth] fields; the fake nodes run in a thread with their own event loop."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from tests.support.fakes import FakeDecodeNode, FakePrefillNode, make_settings


def start_fakes() -> tuple[list, list]:
    """One decode and one prefill fake, serving from a daemon thread's event loop."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="fake-nodes").start()
    decoders = [FakeDecodeNode("decode-0")]
    prefills = [FakePrefillNode("prefill-0", decoders)]
    for node in [*decoders, *prefills]:
        asyncio.run_coroutine_threadsafe(node.start(), loop).result(30)
    return decoders, prefills


def main(argv: list[str]) -> int:
    from gateway.app import serve

    spec = json.loads(open(argv[0]).read())
    decoders, prefills = start_fakes()
    settings = make_settings(decoders, prefills, gateway=spec["gateway"])
    settings.auth = type(settings.auth).model_validate(spec["auth"])
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
