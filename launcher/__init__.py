"""The supervisor: resolves the config, prepares data once, spawns one process per device,
prefixes and logs their output, and tears everything down on the first failure.
It never imports torch at module level, so it starts in a fraction of a second.

Imports run one way, top down (tests/test_import_cycles.py): __main__.py (the entry guard) imports
cli.py; cli.py the launch (launch.py) and its options (attempts.py); launch.py the launch's parts:
attempts.py, prepare.py, local_tier.py, restart_plan.py, compile_cache.py and the folders. No folder
imports cli, launch, attempts or prepare; nodes/ may import local_tier.py and restart_plan.py (the
restart plan one machine's attempts share with the restart rounds of several). At the bottom,
importing no module above them: errors.py, exit_codes.py, address_space.py (standard library only).
Each folder's __init__ says which modules of the others it may import."""
