# %% [markdown]
# # DDP over the machines of a Ray cluster
#
# The same decorator as on one machine, with `nodes=`: fanrun places the ranks with Ray, one
# agent per node runs them, and the call hands back every rank's value. `ray_init()` connects
# to `$RAY_ADDRESS`, or starts a Ray head on this machine. On a cluster without GPUs the ranks
# are CPU processes with gloo. Only the import line differs from the Databricks notebook.

# %%
import os

from fanrun import distributed, ray_init  # was: from databricks.air import distributed, ray_init

print("Ray cluster:", ray_init())


# %%
@distributed(num_accelerators=4, nodes=2)  # 2 ranks on each of 2 machines
def train(steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(256, 10, generator=generator).to(device)
    targets = inputs.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"node {os.environ['NODE_RANK']}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "node": os.environ["FANRUN_NODE_ID"], "losses": losses}


results = train.distributed(steps=50)

# %%
assert [r["rank"] for r in results] == [0, 1, 2, 3]
assert len({r["node"] for r in results}) == 2, "the ranks did not run on two machines"
assert all(r["losses"][-1] < r["losses"][0] / 10 for r in results), "the loss did not go down"
print("4 ranks on 2 machines trained; the loss went down on every one.")
