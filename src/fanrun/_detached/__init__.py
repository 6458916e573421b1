"""Detached runs: a call that goes on when the process that started it ends (@distributed(detach=True)).

store.py keeps each run's files in a private directory; runner.py is the process that supervises
one run, in a session of its own; stream.py carries its output to whoever attaches; run.py is
the caller's handle (fanrun.Run, fanrun.attach, fanrun.runs).
"""
