"""Scripts that run as gloo ranks (support.processes.run_gloo_ranks starts them with tests/ on
PYTHONPATH); a test that needs a worker's constants imports it as support.workers.<name>."""
