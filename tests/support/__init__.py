"""What several test folders share (issue 43: tests/ mirrors the packages, shared helpers in one
place): tests import `support.<module>`, never another test module.

- processes: start, wait for and stop real child processes; the launcher's environment; gloo ranks.
- runs: data configs, prepared datasets, one-line errors, real launcher and debug-training runs.
- gloo_rank: what each worker script in workers/ does as one gloo rank.
- nodes: several launchers on one machine as the nodes of one job.
- gpu_selection, memory_configs: scripted GPUs and the configs the memory plan is tested on.
- checkpointing: tiny trainers and checkpoint layouts.
- hub: a Hugging Face Hub cache filled in a temporary directory (the tests run offline).
- datasets: small token datasets written as the loader reads them.
- evaluation: a checkpoint of the debug model and multiple-choice examples.
- goodput: damaged goodput records.
- grouped_kernels, import_graph: one fixture, and the ast import graph the cycle test reads.
- workers/: scripts run as gloo ranks (processes.run_gloo_ranks).
"""
