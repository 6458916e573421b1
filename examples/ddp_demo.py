"""The job `make demo` runs: a small MLP trained with DDP on every local accelerator
(NCCL on GPUs; CPU processes with gloo where there is none), every rank's result returned."""

import torch

from fanrun import distributed


class SimpleMLP(torch.nn.Module):
    def __init__(self, inputs: int = 32, hidden: int = 64):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(), torch.nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.layers(x)


@distributed()
def run_train(num_epochs: int, batch_size: int) -> dict:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # The same synthetic regression data on every rank; the sampler gives each rank its shard.
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8192, 32, generator=generator)
    targets = torch.sin(inputs @ torch.randn(32, 1, generator=generator) / 32**0.5)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(SimpleMLP().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for batch_inputs, batch_targets in loader:
            batch_inputs, batch_targets = batch_inputs.to(device), batch_targets.to(device)
            loss = torch.nn.functional.mse_loss(model(batch_inputs), batch_targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(batch_inputs), torch.tensor(float(len(batch_inputs)), device=device)])
        dist.all_reduce(total)  # the loss over every rank's shard
        losses.append((total[0] / total[1]).item())
        if rank == 0:
            print(f"epoch {epoch + 1}/{num_epochs}: loss {losses[-1]:.4f}")
    dist.destroy_process_group()
    return {"rank": rank, "device": str(device), "losses": losses}


if __name__ == "__main__":
    results = run_train.distributed(num_epochs=5, batch_size=64)
    for result in results:
        print(f"rank {result['rank']} on {result['device']}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    if not results[0]["losses"][-1] < results[0]["losses"][0]:
        raise SystemExit("the loss did not go down")
    print(f"{len(results)} ranks trained; the loss went down.")
