"""The run directory: which one a launch trains in (new, given, or the one --resume names) and its
one owner (launcher.lock).

May import gpus/claims.py, processes/reaper.py, supervise/printer.py, errors.py and exit_codes.py."""
