# %% [markdown]
# # From Spark's TorchDistributor to fanrun
#
# Code written for `pyspark.ml.torch.distributor.TorchDistributor` runs unchanged with
# `fanrun.TorchDistributor`, without Spark: same constructor, same `run(train_object, *args)`,
# rank 0's result returned. The second half shows the same training as `@distributed`, which
# returns every rank's result.
#
# ```python
# from pyspark.ml.torch.distributor import TorchDistributor   # before
# from fanrun import TorchDistributor                         # after
# ```

# %%
import torch

from fanrun import TorchDistributor, distributed

USE_GPU = torch.cuda.is_available()


# %%
def train_fn(learning_rate: float, steps: int) -> dict:
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        inputs = torch.randn(64, 16, generator=generator).to(device)
        loss = (model(inputs) - inputs.sum(dim=1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"rank {dist.get_rank()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
    return {"rank": int(os.environ["RANK"]), "first_loss": losses[0], "last_loss": losses[-1]}


# %%
# Spark's form: rank 0's result.
rank0 = TorchDistributor(num_processes=2, local_mode=True, use_gpu=USE_GPU).run(train_fn, 0.05, 100)
print("TorchDistributor returned", rank0)

# %%
# fanrun's form: every rank's result, in rank order.
every_rank = distributed(num_accelerators=2, accelerator_type=None if USE_GPU else "CPU")(train_fn).distributed(0.05, 100)
print("@distributed returned", every_rank)

# %%
assert rank0["rank"] == 0 and rank0["last_loss"] < 0.1 * rank0["first_loss"]
assert [r["rank"] for r in every_rank] == [0, 1] and every_rank[0] == rank0
print("Both forms trained the same model; TorchDistributor returned rank 0's result.")
