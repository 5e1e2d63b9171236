"""Supervising one group of workers: the event loop and its teardown rules, the record it keeps of the run, its
options, where lines go (console prefixes and logs), and what the run came to (outcome and failure summary).

May import processes/ (the workers it watches), nodes/node.py (a node's words: stops, interrupts, peers),
rundir/lock.py, and launcher/address_space.py, exit_codes.py; never launch, attempts or the rest of nodes/.
Inside, supervisor.py over run_state.py over outcome.py over summary.py. printer.py, restarts.py (the restart
rules, restarts.jsonl), options.py and goodput.py import no launcher module: nodes/, rundir/ and gpus/ may import them."""
