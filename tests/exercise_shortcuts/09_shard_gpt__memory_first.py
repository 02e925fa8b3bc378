"""the tie survives sharding: head.weight is token.weight, one parameter, and the model holds no second copy

Forbidden shortcut of exercise 09_shard_gpt: to_empty before fully_shard (the tie is lost).
"""
import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

VOCAB, WIDTH, CONTEXT, LAYERS, HEADS = 64, 32, 16, 2, 2
STEPS, WINDOWS = 3, 8  # optimizer steps; windows in each step's global batch, dealt out to the ranks
BUILT_ON = []  # given: the device type of every GPT this process builds, for the check


class Block(nn.Module):
    """Given: a pre-norm transformer block, causal self-attention then an MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Given: token and position embeddings, the blocks, a final norm, and a head tied to the token embedding."""

    def __init__(self):
        super().__init__()
        self.token, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.token.weight  # tied: one matrix reads tokens in and scores them out
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        BUILT_ON.append(self.token.weight.device.type)  # given

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_whole():
    """Given: the model whole, with the seed's weights (what one process would train)."""
    torch.manual_seed(0)
    return GPT()


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.5, momentum=0.9)  # given


def global_batch(step):
    """Given: the step's whole batch, the same on every rank: inputs, and targets in which -100 marks padding (the
    odd windows' last 10 targets), so that the rank holding the odd windows holds fewer targets."""
    tokens = torch.randint(0, VOCAB, (WINDOWS, CONTEXT + 1), generator=torch.Generator().manual_seed(step))
    targets = tokens[:, 1:].clone()
    targets[1::2, -10:] = -100
    return tokens[:, :-1], targets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="given: a folder for the check")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    with torch.device("meta"):  # shapes only, no memory and no values; the constructor ties the head
        model = GPT()
    model.to_empty(device="cpu")  # the shortcut: memory first, on the plain model: the head gets a parameter of its own
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    set_model_state_dict(model, build_whole().state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        mine = slice(rank, None, world_size)  # this rank's windows: every world_size-th
        logits = model(inputs[mine])
        count = (targets != -100).sum()  # every rank holds the whole batch's targets: no message needed
        # this rank's sum over the step's count, times world_size: FSDP2 averages the gradients over the ranks
        loss = F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten(), ignore_index=-100,
                               reduction="sum") * world_size / count
        optimizer.zero_grad()
        loss.backward()
        if step == 0:  # given: the first step's whole gradient, for the check (full_tensor gathers: every rank)
            gradient = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                        for name, p in model.named_parameters()}
        optimizer.step()
        logged = loss.detach().clone()  # given: the ranks' losses averaged, as FSDP2 averages their gradients
        dist.all_reduce(logged)
        losses.append(logged.item() / world_size)
    # given: what the check reads
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    record = {"losses": losses, "elements_held": held, "elements": sum(p.numel() for p in model.parameters()),
              "tied": model.head.weight is model.token.weight, "built_on": BUILT_ON,
              "units": {"blocks": [isinstance(block, FSDPModule) for block in model.blocks],
                        "root": isinstance(model, FSDPModule)},
              "targets": int((targets[mine] != -100).sum())}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if rank == 0:
        torch.save(gradient, os.path.join(args.out, "gradient.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
