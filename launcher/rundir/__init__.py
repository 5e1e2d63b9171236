"""The run directory: which one a launch trains in (new, given, or the one --resume names) and its
one owner (launcher.lock)."""
