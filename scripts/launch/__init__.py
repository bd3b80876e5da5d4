"""toppings-launch: a node's servers on disjoint cores, supervised."""
