"""Running on several ranks: where this process runs (rank, device, process group), how the model is
spread (DDP or FSDP2, compile, activation checkpointing), and a collective that failed because a
peer went away."""
