"""Optimizers and learning-rate schedules: AdamW, Muon (and its orthogonalization spread over
the ranks), the schedules pretrain/registry.py names."""
