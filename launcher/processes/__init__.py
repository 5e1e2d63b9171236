"""The processes of a run: one worker (its environment, process group, exit), torchrun's
variables, every process a run started (including escaped ones), and the guardian that cleans up
after a launcher that could not.

May import gpus/devices.py (the visibility variables) and launcher/address_space.py, exit_codes.py;
nothing of supervise/, nodes/ or above. Inside, run_processes.py over guardian.py over worker.py over
torchrun_env.py; reaper.py imports none of them."""
