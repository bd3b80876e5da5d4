"""toppings-loadgen: open-loop load from a workload or a trace, and its summary."""
