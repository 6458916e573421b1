# %% [markdown]
# # DDP quickstart
#
# A small MLP trained with PyTorch DistributedDataParallel on every accelerator of this
# machine (CPU processes with gloo where there is no GPU), from a notebook. The code is the
# Databricks serverless GPU example's; only the import line differs.

# %%
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fanrun import distributed  # was: from serverless_gpu import distributed


# %%
class SimpleMLP(nn.Module):
    def __init__(self, input_dim=10, hidden_dim=64, output_dim=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x):
        return self.net(x)


def setup():
    """Joins the process group: NCCL on GPUs, gloo on CPUs."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def cleanup():
    dist.destroy_process_group()


# %%
@distributed()
def run_train(num_epochs: int, batch_size: int) -> dict:
    import mlflow

    device = setup()
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(42)
    inputs = torch.randn(4096, 10, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) + 0.1 * torch.randn(4096, 1, generator=generator)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(SimpleMLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    epoch_losses = []
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for batch_inputs, batch_targets in loader:
            batch_inputs, batch_targets = batch_inputs.to(device), batch_targets.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(batch_inputs), batch_targets)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(batch_inputs), count + len(batch_inputs)
        epoch_losses.append(total / count)
        print(f"epoch {epoch}: loss {epoch_losses[-1]:.4f}")
        if rank == 0:
            mlflow.log_metric("train_loss", epoch_losses[-1], step=epoch)
    cleanup()
    return {"rank": rank, "device": str(device), "losses": epoch_losses}


# %%
results = run_train.distributed(num_epochs=3, batch_size=64)
for result in results:
    print(f"rank {result['rank']} on {result['device']}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")

# %%
assert [r["rank"] for r in results] == list(range(len(results)))
assert all(r["losses"][-1] < r["losses"][0] for r in results), "the loss did not go down"
print(f"{len(results)} ranks trained; the loss went down on every one.")
