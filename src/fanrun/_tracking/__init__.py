"""MLflow tracking, the caller's half: one MLflow run per call of a tracked function.

The caller never imports mlflow. The first tracked call starts the process's agent, a process
of its own that imports mlflow once and serves every later call; the caller hands it each call
and the call's outcome over a socket, and the agent makes, fills and closes the runs.

  hook.py              tracking as the call path (_launch/call.py) plugs it in: the call, each attempt
  caller.py            a call's run as the caller sees it: track(), flush_tracking()
  agent_connection.py  the caller's end of the agent: starts it, sends calls, reads answers
  agent_channel.py     the messages between the two
  agent.py             the agent process's main loop
  agent_run.py         one call's run inside the agent: made, fed, closed
  rank_values.py       the ranks' params and tags: rank 0's under key, the others' under key/rank_N where they differ
  system_metrics.py    CPU, memory and GPU samples for the run
  rank_steps.py        each rank's step time and its waits, read from the ranks' progress records with each sample
  links.py             the run's line or link in the caller's output
  store.py             fanrun's default store ($XDG_DATA_HOME/fanrun/mlflow)
  ui.py                `fanrun ui`

The rank's half lives with what runs inside a rank, named in pairs with this one:
_rank/tracking.py (the run made active in the rank; tracking_off.py when not tracked) and
_rank/metric_sender.py, whose stream backends/metric_relay.py receives (the host's end of it,
served by the agent here and by a cluster's node agent there) and hands to agent_run.py.
"""
