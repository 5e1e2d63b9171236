"""Supervising one group of workers: the event loop and its teardown rules, its options, where
lines go (console prefixes and logs), and what the run came to (outcome and failure summary)."""
