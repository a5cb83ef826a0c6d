"""geotrain: the command-line entry point (`geotrain ...`)."""
