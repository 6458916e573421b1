# %% [markdown]
# # FSDP: a small transformer language model, sharded
#
# Trains a small causal transformer with FSDP2 (`fully_shard`) and with the
# `FullyShardedDataParallel` wrapper, on every accelerator of this machine (bf16 mixed
# precision on GPUs; CPU processes with gloo where there is none), saves a sharded
# checkpoint with `torch.distributed.checkpoint`, loads it into a new model and checks that
# the new model's outputs match.

# %%
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fanrun import distributed

CHECKPOINTS = tempfile.mkdtemp(prefix="fsdp-example-")


# %%
class TinyLM(nn.Module):
    """A causal transformer language model: embeddings, a few encoder blocks with a causal mask, a head."""

    def __init__(self, vocab=256, width=128, heads=4, depth=2, context=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def batches(steps, batch_size=16, context=64, vocab=256):
    """A learnable synthetic language: each token is the previous one plus one, modulo vocab."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch_size, 1), generator=generator)
        yield (start + torch.arange(context + 1)) % vocab


def join():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    return torch.device("cpu")


# %%
@distributed()
def train_fsdp(wrapper: str, steps: int, checkpoint_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard

    device = join()
    rank = dist.get_rank()
    on_gpu = device.type == "cuda"

    def shard(model):
        if wrapper == "fully_shard":  # FSDP2: each block, then the root
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            return fully_shard(model, mp_policy=policy)
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else None
        return FullyShardedDataParallel(model, device_id=device, mixed_precision=precision, use_orig_params=True)

    torch.manual_seed(0)
    model = shard(TinyLM().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step, batch in enumerate(batches(steps)):
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"{wrapper} step {step}: loss {loss.item():.3f}")

    # Each rank writes its own shards; a new, differently initialised model loads them back.
    path = os.path.join(checkpoint_dir, wrapper)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    torch.manual_seed(1)
    restored = shard(TinyLM().to(device))
    state = {"model": get_model_state_dict(restored)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(restored, state["model"])
    probe = next(batches(1)).to(device)[:, :-1]
    with torch.no_grad():
        difference = (model(probe).float() - restored(probe).float()).abs().max().item()
    dist.destroy_process_group()
    return {"rank": rank, "first_loss": losses[0], "last_loss": losses[-1], "restored_max_difference": difference}


# %%
results = {}
for wrapper in ("fully_shard", "FullyShardedDataParallel"):
    results[wrapper] = train_fsdp.distributed(wrapper, steps=60, checkpoint_dir=CHECKPOINTS)
    for r in results[wrapper]:
        print(f"{wrapper} rank {r['rank']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, restored model differs by {r['restored_max_difference']:.2e}")

# %%
for wrapper, ranks in results.items():
    assert all(r["last_loss"] < 0.5 * r["first_loss"] for r in ranks), f"{wrapper}: the loss did not go down"
    assert all(r["restored_max_difference"] == 0.0 for r in ranks), f"{wrapper}: the restored model differs"
print("FSDP2 and FSDP1 trained; both checkpoints restored exactly.")
