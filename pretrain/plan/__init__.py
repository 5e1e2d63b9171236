"""Decided from the config before anything is built (torch-free, the launcher runs it): GPU memory
per rank, host memory and the parallelism plan, and what torch.compile needs on the machine."""
