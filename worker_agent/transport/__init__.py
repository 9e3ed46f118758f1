"""Block transports between agents, behind one interface (``base.BlockTransport``)."""
