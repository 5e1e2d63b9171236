"""The processes of a run: one worker (its environment, process group, exit), torchrun's
variables, every process a run started (including escaped ones), and the guardian that cleans up
after a launcher that could not."""
