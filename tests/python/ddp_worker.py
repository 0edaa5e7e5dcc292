"""A rank of the DDP and FSDP tests (tests/python/hf/test_optimize.py): trains a patched small
BERT with DistributedDataParallel, or with FSDP2 (fully_shard per encoder layer and the
whole model), over Gloo on this machine's loopback, for a given number of steps, on its half
of each batch; rank 0 saves the final parameters (gathered from the shards under FSDP)."""

import copy
import gc
import os

import torch
import torch.distributed as dist
import transformers
from configs import tiny_bert

import tempo

STEPS, BATCH, SEQ = 10, 8, 16


def make_model():
    cfg = tiny_bert()
    torch.manual_seed(0)
    return tempo.optimize(transformers.BertForMaskedLM(cfg).train(), attention="tempo")


def batches():
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        ids = torch.randint(1, 128, (BATCH, SEQ), generator=g)
        yield ids.masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.25, 0), ids


def loss_of(model, inputs, labels):
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train_single():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in batches():
        opt.zero_grad()
        loss_of(model, inputs, labels).backward()
        opt.step()
    return model


def wrap(model, mode):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    return fully_shard(model)


def full_state(model, mode):
    if mode == "ddp":
        return copy.deepcopy(model.module.state_dict())
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def run(rank, world, port, out, mode="ddp"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = wrap(make_model(), mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        half = BATCH // world
        for inputs, labels in batches():
            sl = slice(rank * half, (rank + 1) * half)
            opt.zero_grad()
            loss_of(model, inputs[sl], labels[sl]).backward()  # DDP / FSDP average the ranks' gradients
            opt.step()
        state = full_state(model, mode)  # a collective under FSDP: every rank takes part
        if rank == 0:
            torch.save(state, out)
        # Neither rank tears down its Gloo pairs while the other still uses them (a rank that
        # left early made its peer abort in teardown, under load): meet, drop DDP's reducer
        # (it holds the group), then destroy.
        dist.barrier()
        del model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()
