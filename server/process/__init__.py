"""Process-level rules of a server, set in one place and in one order by `toppings-serve`
(server/cli.py) before the model loads:

1. Native memory (`allocator.py`): glibc's arenas capped and trimmed, oneDNN's shape caches
   bounded, so a server that runs for days holds what it uses.
2. Threads (`threads.py`): one OpenMP team in the process, the engine thread's; the model loads
   on a thread that ends, every other long-lived thread runs torch on itself alone.
3. The engine thread's team size (`thread_governor.py`): measured from the decode steps it runs,
   not guessed, since a neighbour on the host changes the best count by the minute.
4. The memory probe (`memory_probe.py`): off unless an operator asks for it by environment.
5. The start-up heap frozen out of the garbage collector's walk (`gc_heap.py`), once the server
   is built and before its first request.

An operator's own environment (MALLOC_ARENA_MAX, GLIBC_TUNABLES, ONEDNN_*, OMP_NUM_THREADS
through `--torch-threads`) always wins over these defaults. Nothing here imports a room above
the settings.
"""
