"""The next token of each row: logits processing (`logits.py`), the scan for non-finite rows
(`logits_scan.py`), sampling (`next_token.py`), structured output's grammars and their masks
(`grammar.py`, `schema_finite.py`, `schema_refs.py`), and the sampler that runs a step's rows
through them (`sampler.py`)."""
