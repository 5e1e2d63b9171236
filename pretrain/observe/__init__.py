"""What a run shows: metrics (throughput, MFU, memory), the step line, stragglers, Weights & Biases, and plots."""
