"""A whole site on one machine (`make site`, docs/site.md): the launcher (launch: each node its own process at its
own loopback address), the shaped KV link relays (link) and a second gateway over a running site's nodes
(second_gateway, for benches that compare against the first). May import backends.cli's up and kv_bridge."""
