"""The call as data: the rank program, the run's paths, the payload."""
