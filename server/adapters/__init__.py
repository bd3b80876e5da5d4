"""The adapter lifecycle as the engine sees it: names resolved to ids once (`registry.py`), an
adapter directory checked before it is read (`reader.py`), what a registration holds outside the
device cache (`host.py`: host tensors charged to the budget, the CPU workers' arena), the LoRA
side of each step (`step.py`), and the one interface the engine uses (`manager.py`)."""
