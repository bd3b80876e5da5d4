"""The cluster simulator: synthetic traces, simulated servers with their host adapter memory, and
the event loop that drives the live routing policies over them."""
