"""The engine loop: continuous batching over the scheduler's plans, the model runner, the
async step pipeline and the engine's reports."""
