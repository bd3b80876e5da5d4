"""Device side of LoRA serving: adapter format, device adapter cache, pipelined loader, kernels."""
