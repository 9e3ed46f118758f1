"""kvgate worker agent: tiered KV block store, block transports, vLLM-format KV events.

The only package of the project that imports torch.  Modules: ``blockfmt`` (block serialisation),
``placement`` (pure LRU/tier planner), ``tiers`` (memory and disk tiers), ``store``
(``KVBlockStore``), ``events`` (vLLM KV event encoding), ``keys`` (block keys from the shared
prefix hash), ``transport`` (TCP and torch.distributed), ``bench_transfer`` (benchmark),
``migration`` (pure: pull-vs-recompute, hot-prefix replication, block versions), ``publisher``
(KV events over ZMQ), ``shared`` (held prefixes into the gateways' shared store), ``service`` +
``api`` + ``cli_args`` (``kvgate agent``: the control API and the data port).
"""
