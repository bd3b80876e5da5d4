"""The HTTP front shared by toppings-serve and toppings-scheduler: waitress sizing, the
in-flight limit, the guarded waitress server and the drain on SIGTERM. Imports nothing of
toppings."""
