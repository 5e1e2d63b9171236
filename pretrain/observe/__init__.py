"""What a run shows: metrics (throughput, MFU, memory), the step line, Weights & Biases, and plots."""
