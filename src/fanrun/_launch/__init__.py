"""The caller's launch machinery: one call from its record to its end, its ranks started through a
backend, their output relayed, and the outcome turned into results or an exception.

  call.py         plan() and run(): the one call path, every door's
  records.py      every run's record, blocking or detached: its id, state, runner, pruning
                  (record_files.py: its files; record_watch.py: waiting on one)
  run.py          one attempt: its ranks through a backend, their output, their outcome
  gpu_locks.py    the GPUs a call holds while it runs
  preflight.py    what would stop a run halfway, found before anything starts
  signals.py      Ctrl+C waking the wait
  outcome.py      results, or the root cause's exception (hints.py: plain words for known causes)
  running_calls.py, stacks.py   the ranks of the calls that run, and `fanrun stacks`
  rank_logs.py    a run's output read back from its ranks' logs (`fanrun logs`, `attach`)
  file_changes.py waiting for files to change (inotify), never by polling
"""
