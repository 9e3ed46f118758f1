"""Migration hints on the request path: ``Decision.pull_from`` -> the body's ``kv_transfer_params``.

When the policy routes a request away from the replica holding its prefix and expects the chosen
replica to pull that prefix (``Decision.pull_from``, ``Decision.pull_tokens``), the forwarded
JSON body gets::

    "kv_transfer_params": {..., "kvgate_pull_from": "<holder's base URL>",
                                "kvgate_pull_tokens": <tokens to pull>}

merged into whatever ``kv_transfer_params`` the client sent (vLLM hands this object to its KV
connector; the simulator reads it, see ``gateway.sim.kvpull``).  Only then is the body
re-serialised; every other request is forwarded byte for byte.
"""

from __future__ import annotations

import orjson

from policies.types import Decision


def pull_hint_body(parsed: dict, decision: Decision, pool) -> bytes | None:
    """The body with the hint added, or None when there is no usable hint (send it unchanged)."""
    if decision.pull_from is None or decision.pull_from == decision.replica:
        return None
    holder = pool.get(decision.pull_from)
    if holder is None or not isinstance(parsed, dict):
        return None
    params = parsed.get("kv_transfer_params")
    hint = dict(params) if isinstance(params, dict) else {}
    hint["kvgate_pull_from"] = holder.url.rstrip("/")
    hint["kvgate_pull_tokens"] = decision.pull_tokens
    return orjson.dumps({**parsed, "kv_transfer_params": hint})
