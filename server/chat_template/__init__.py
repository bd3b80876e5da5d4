"""Chat templates: the operator's file checked and read (`file`), compiled and rendered in a
sandbox under a budget (`sandbox`), and chat messages rendered to prompt text with template
failures as the client's 400 (`render`). Below the HTTP layer, which renders through it, and
above the request contract, whose RequestError it raises."""
