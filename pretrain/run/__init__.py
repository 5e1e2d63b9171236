"""A process's run, standard library only (the launcher imports these): the run directory and
atomic writes, exit codes, the one-line refusal, graceful stops, parent death, thread variables,
shared caches, the command's name, scripted faults (PRETRAIN_FAULTS, a testing aid)."""
