"""The model: a Llama-style transformer, its feed-forward blocks (dense SwiGLU, mixture of experts),
the training loss, and what recomputation costs in FLOPs."""
