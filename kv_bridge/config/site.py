"""`[site]`: the one-machine rehearsal of a site (`make site`, backends/site/launch.py): how its KV links are shaped.

Real sites leave it out; only backends/site/launch.py and backends/site/link.py read it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SiteConfig(BaseModel):
    """Each decode node with a kv_advertise_host gets a link relay there: it forwards to kv_host:kv_port at
    link_bytes_per_s (prefill -> decode; the other way unshaped), like the site's 10GbE NIC in front of each Mac."""

    link_bytes_per_s: float | None = Field(default=None, gt=0, description="KV link rate of every relay, bytes/s "
                                           "(None: relays forward unshaped)")
    control_port: int = Field(default=8300, ge=1, le=65535, description="each relay's HTTP control port on its "
                              "kv_advertise_host: GET /health, POST /cut, POST /restore")
    state_dir: str = Field(default=".disagg/site", description="keys, secret, logs and site models; relative to "
                           "the config file's folder")
