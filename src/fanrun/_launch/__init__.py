"""The caller's launch machinery: one call's run directory, its ranks started through a backend,
their output relayed, and the outcome turned into results or an exception.

  run.py        run(): the whole of one call, whatever the backend
  program.py    what every rank runs (fanrun's worker in a mode, or a native program)
  preflight.py  what would stop a run halfway, found before anything starts
  paths.py      the run's directory and files, private to the caller
  rendezvous.py the port and torch store the ranks meet at
  output.py     the ranks' output, labelled, to the caller's streams (output_views.py: how)
  signals.py    Ctrl+C waking the wait
  outcome.py    results, or the root cause's exception (hints.py: plain words for known causes)
"""
