"""Training: config, model, data, the loop. Importing this package does not import torch."""
