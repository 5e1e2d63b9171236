"""Several nodes: which node this is (flags, Slurm), the rendezvous through node 0's store
(key_value.py, standard library only: no launcher imports torch),
what one node tells the others when it stops, and a node's account of its own silence.

May import gpus/ (placement, selection), processes/torchrun_env.py, rundir/, supervise's printer.py and
restarts.py (the restart rules), errors.py and exit_codes.py, and, for restart_rounds.py alone,
launcher/restart_plan.py (what a restart runs on and from, shared with one machine's attempts) and
local_tier.py (which uses rendezvous.py's Node); never launch or attempts. Inside, restart_rounds.py
over between_rounds.py, job_end.py, round_checkin.py and multinode.py, over rendezvous.py and watch.py,
over store.py (over key_value.py) and node.py (a node's spec and words, which supervise/ imports too)."""
