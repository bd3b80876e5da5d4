"""The HTTP front shared by toppings-serve and toppings-scheduler: waitress sizing, the
in-flight limit, and the guarded waitress server. Imports nothing of toppings."""
