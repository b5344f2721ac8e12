"""One tiny-gpt_oss stack for the e2e modules on the gpt_oss family (test_gpt_oss_e2e, test_agents_gpt_oss_e2e,
test_tool_loop_e2e, test_gpt_oss_json_e2e): one decode node (mlx-cpu) and one gateway, started on first use and kept
for the session. No prefill node: the local path.

The decode node serves two models: the tiny family checkpoint (tests/support/tiny_models.py) as MODEL_ID and the scripted
one (tests/support/scripted_gpt_oss.py) as SCRIPTED_ID. The gateway reaches it through a recording proxy, so the tool loop can
read the token ids the node received; the proxy relays a node's stream whole, which none of these modules times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.recording_proxy import RecordingProxy
from tests.support.scripted_gpt_oss import build_scripted_gpt_oss
from tests.support.stack import Stack
from tests.support.tiny_models import build_family

SCRIPTED_ID = "oss-scripted:tiny"


@dataclass
class OssStack:
    stack: Stack
    proxy: RecordingProxy
    folder: Path  # the tiny gpt_oss family checkpoint, served as stack.MODEL_ID
    scripted: Path  # the scripted checkpoint, served as SCRIPTED_ID


@pytest.fixture(scope="session")
def oss_stack(tmp_path_factory):
    """The shared stack (module docstring), defined once through conftest.py, stopped at the session's end."""
    root = tmp_path_factory.mktemp("oss-stack")
    folder = build_family("gpt_oss", root / "gpt_oss")
    scripted = build_scripted_gpt_oss(root / "scripted")
    s = Stack(root, model_dir=folder)
    text = s.config.read_text()
    model = text[text.index("[[models]]"):]  # the stack's one model; the scripted one on the same nodes
    s.config.write_text(text + "\n" + model.replace(f'id = "{s.settings.models[0].id}"', f'id = "{SCRIPTED_ID}"')
                        .replace(f'path = "{folder}"', f'path = "{scripted}"'))
    proxy = None
    try:
        s.start("decode-0")
        proxy = RecordingProxy(s.url("decode-0"))
        port = s.settings.node("decode-0").port
        proxied = root / "gateway.toml"  # the same config with decode-0's HTTP port swapped for the proxy's
        proxied.write_text(s.config.read_text().replace(f"port = {port}\n", f"port = {proxy.port}\n", 1))
        s.config = proxied
        s.start("gateway")
        yield OssStack(s, proxy, folder, scripted)
    finally:
        s.stop()
        if proxy is not None:
            proxy.close()
