"""The HTTP front shared by toppings-serve and toppings-scheduler: waitress sizing, the
in-flight limit, the guarded waitress server, the drain on SIGTERM, the listen flags and the one
`/metrics` route. Imports nothing of toppings but the settings generator (server.settings)."""
