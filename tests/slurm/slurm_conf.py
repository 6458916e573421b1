"""The slurm.conf of the local cluster: a controller and two nodes on this one host, each daemon
on a port of its own on 127.0.0.1, with every file it keeps (state, spool, pids, logs) under the
cluster's folder. No cgroup.conf: the plugins chosen track and confine nothing through cgroups."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from loopback_address import SECOND_ADDRESS

NODES = ("node1", "node2")
CONTROLLER_PORT = 17000
# node1 listens on 17001, node2 on 17002: two slurmd on one address need a port each.
NODE_PORTS = "17001-17002"
# node1's NodeAddr: the loopback address the cluster adds (loopback_address.py), not 127.0.0.1.
FIRST_NODE_ADDRESS = SECOND_ADDRESS
CPUS_PER_NODE = 2
GPUS_PER_NODE = 2

TEMPLATE = """\
ClusterName=fanrun-test
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={directory}/state
# %n is the node's name: each slurmd (`slurmd -N node1`) keeps its own spool, pid file and log.
SlurmdSpoolDir={directory}/spool/%n
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmdLogFile={directory}/slurmd-%n.log
SlurmctldPidFile={directory}/slurmctld.pid
SlurmctldLogFile={directory}/slurmctld.log
# No cgroups: processes are tracked by their parents, and tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# A batch job starts as soon as it is submitted, not at the next of the scheduler's passes 3 s apart.
SchedulerParameters=batch_sched_delay=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# No mail goes from here, and the default, /bin/mail, is not installed.
MailProg=/bin/true
# A node that registers after being marked down (a slow start) comes back idle by itself.
ReturnToService=2
# A cancelled task that ignores SIGTERM is killed this soon after it.
KillWait=5
# Two GPUs a node as Slurm counts them (gres.conf), with no GPU behind them: a call can ask for
# them (gres=gpu:2), and the nodes' GPUs are what the health gate's recorded NVML answers say.
GresTypes=gpu
# node1's address is not the one this host's name resolves to (127.0.0.1): a rank's MASTER_ADDR
# must be node1's NodeAddr, which only `scontrol show node` tells.
NodeName=node1 NodeHostname={hostname} NodeAddr={first_address} Port={first_port} CPUs={cpus} RealMemory=2000 Gres=gpu:{gpus}
NodeName=node2 NodeHostname={hostname} NodeAddr=127.0.0.1 Port={second_port} CPUs={cpus} RealMemory=2000 Gres=gpu:{gpus}
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def write_slurm_conf(directory: Path, hostname: str, munge_socket: Path) -> Path:
    path = directory / "slurm.conf"
    first_port, second_port = NODE_PORTS.split("-")
    path.write_text(TEMPLATE.format(hostname=hostname, controller_port=CONTROLLER_PORT, munge_socket=munge_socket,
                                    directory=directory, first_address=FIRST_NODE_ADDRESS, first_port=first_port,
                                    second_port=second_port, cpus=CPUS_PER_NODE, gpus=GPUS_PER_NODE))
    # Slurm reads gres.conf beside slurm.conf. Its GPUs must be device files: each one here is
    # another name for /dev/null, never opened.
    devices = directory / "gpus"
    devices.mkdir()
    for index in range(GPUS_PER_NODE):
        os.mknod(devices / f"gpu{index}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (directory / "gres.conf").write_text(f"NodeName=node[1-2] Name=gpu File={devices}/gpu[0-{GPUS_PER_NODE - 1}]\n")
    for name in NODES:
        (directory / "spool" / name).mkdir(parents=True)
    (directory / "state").mkdir()
    return path
