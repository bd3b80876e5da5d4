"""The OpenAI-compatible routes: bodies validated into engine requests (`schema.py`,
`choices.py`), structured output and tools, replies and streams with logprobs, vLLM's
`/tokenize`, and the model catalog."""
