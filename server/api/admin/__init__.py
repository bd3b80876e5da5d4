"""Adapters at run time: load and unload (`lifecycle.py`: path confinement and the logic), the
PEFT files of a held adapter and their digest (`files.py`), LoRAServe's fetch from a peer
(`peer_fetch.py`), and their routes (`routes.py`)."""
