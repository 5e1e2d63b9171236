"""Checkpoints: saving and restoring everything a run needs to continue exactly, the directories
on disk and which are complete, the sharded (DCP) part, model and optimizer state through any
wrapper, random generators, which checkpoint `--resume` means, and reading one back for the
commands. files.py and resume.py are standard library only (the launcher reads them)."""
