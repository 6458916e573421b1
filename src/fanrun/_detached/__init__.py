"""Detached runs: a call that goes on when the process that started it ends (@distributed(detach=True),
`fanrun submit`).

Every run's record is the launcher's (_launch/records.py); what only a detached run has is here:
runner.py is the process that supervises one run, in a session of its own, through the one call
path; stream.py carries its output to whoever attaches; files.py names the files a detached run's
record holds beyond every run's; keys.py holds `fanrun submit`'s idempotency keys; ray_job.py and
ray_driver.py run a workload of several nodes as a Ray job; run.py is the handle of any run, blocking
or detached (fanrun.Run, fanrun.attach, fanrun.runs).
"""
