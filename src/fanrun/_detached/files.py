"""What a detached run's record holds beyond every run's (_launch/records.py):

    spec.pkl      what to run: the call's payload, its options, the caller's sys.path and directory
    output.log    everything the call printed, as a blocking call prints it in the cell
    runner.log    what the runner's descriptors 1 and 2 got below Python (the engine's own warnings)
    attach.sock   while the runner lives: where attach() reads the output live (stream.py)
    reserved      while the runner lives: room held on the disk for the final state, released
                  just before it is written, so that a full disk never loses a run's end
"""

SPEC = "spec.pkl"
OUTPUT = "output.log"
RUNNER_LOG = "runner.log"
SOCKET = "attach.sock"
RESERVED = "reserved"
