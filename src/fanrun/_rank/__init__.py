"""What runs inside each rank. Standard library only at import: a rank loads these files by
path (worker.py with runpy, the others from it), never through the fanrun package, so its
start-up costs the user's imports and nothing more.

  worker.py       read the call, run it, send back a result or an error envelope
  contract.py     the run contract: file names, environment names, control messages
  result_file.py  a result on disk, large tensors out of band (the caller reads it too)
  tracking.py     the rank's half of MLflow tracking: the call's run made active when mlflow is imported
  call_store.py   the tracking store as the rank sees it: the call's run without MLflow's store
  tracking_off.py what a rank's MLflow does when the call is not tracked: logs nowhere
  metric_sender.py the rank's end of the metric stream (the caller's end: backends/metric_relay.py)
"""
