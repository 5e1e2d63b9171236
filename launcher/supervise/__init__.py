"""Supervising one group of workers: the event loop and its teardown rules, the record it keeps of the run, its
options, where lines go (console prefixes and logs), and what the run came to (outcome and failure summary)."""
