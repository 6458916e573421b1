# %% [markdown]
# # DeepSpeed ZeRO stage 2 and stage 3
#
# The same small causal language model trained with DeepSpeed from a config dict, under
# ZeRO stage 2 and stage 3, on every accelerator of this machine (bf16 and NCCL on GPUs;
# DeepSpeed's CPU accelerator with gloo where there is no GPU). Each run saves a DeepSpeed
# checkpoint and loads it into a new engine whose outputs must match.

# %%
import os
import tempfile

import torch
import torch.nn as nn

from fanrun import distributed

CHECKPOINTS = tempfile.mkdtemp(prefix="deepspeed-example-")


# %%
class TinyLM(nn.Module):
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


def batches(steps, rank, batch_size=8, context=64, vocab=256):
    """Each token is the previous one plus one, modulo vocab: a language the model can learn."""
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch_size, 1), generator=generator)
        yield (start + torch.arange(context + 1)) % vocab


# %%
@distributed()
def train_deepspeed(stage: int, steps: int, checkpoint_dir: str) -> dict:
    import deepspeed
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's fused optimizers would be compiled at first use.
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 10**9,
    }

    def engine():
        torch.manual_seed(0)
        model = TinyLM()
        ds_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return ds_engine

    model = engine()
    losses = []
    for step, batch in enumerate(batches(steps, rank)):
        batch = batch.to(model.device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"ZeRO-{stage} step {step}: loss {loss.item():.3f}")

    path = os.path.join(checkpoint_dir, f"zero{stage}")
    model.save_checkpoint(path, tag="final")
    restored = engine()
    restored.load_checkpoint(path, tag="final")
    probe = next(batches(1, rank)).to(model.device)[:, :-1]
    model.eval()
    restored.eval()
    with torch.no_grad():
        difference = (model(probe).float() - restored(probe).float()).abs().max().item()
    dist.destroy_process_group()
    return {"rank": rank, "first_loss": losses[0], "last_loss": losses[-1], "restored_max_difference": difference}


# %%
results = {}
for stage in (2, 3):
    results[stage] = train_deepspeed.distributed(stage, steps=40, checkpoint_dir=CHECKPOINTS)
    for r in results[stage]:
        print(f"ZeRO-{stage} rank {r['rank']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, restored model differs by {r['restored_max_difference']:.2e}")

# %%
for stage, ranks in results.items():
    assert all(r["last_loss"] < 0.5 * r["first_loss"] for r in ranks), f"ZeRO-{stage}: the loss did not go down"
    assert all(r["restored_max_difference"] == 0.0 for r in ranks), f"ZeRO-{stage}: the restored model differs"
print("ZeRO-2 and ZeRO-3 trained; both checkpoints restored exactly.")
