"""The HTTP side of one server: the Flask app and what its routes share (`app.py`, `context.py`,
the operator's HTTP options, the tokenizer pool, metrics and the gateway protocol's series);
`openai/` the OpenAI-compatible generation routes (schema, choices, replies, logprobs,
structured output, tools, the catalog); `admin/` the adapter admin (load and unload at run
time, path confinement, the files peers fetch, fetching from peers)."""
