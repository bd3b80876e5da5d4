"""The model forward: Llama family, attention, linear layers, fused ops, loader, CUDA graphs."""
