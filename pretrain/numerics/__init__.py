"""Numerical safety: the first non-finite loss or gradient norm caught, the tensors that caused
it dumped, and what every rank does then."""
