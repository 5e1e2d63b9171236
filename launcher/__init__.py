"""The supervisor: resolves the config, prepares data once, spawns one process per device,
prefixes and logs their output, and tears everything down on the first failure.
It never imports torch at module level, so it starts in a fraction of a second."""
