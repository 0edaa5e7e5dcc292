"""A rank of the DDP test (tests/python/test_optimize.py): trains a patched small BERT with
DistributedDataParallel over Gloo on this machine's loopback, for a given number of steps,
on its half of each batch; rank 0 saves the final parameters."""
import copy
import gc
import os

import torch
import torch.distributed as dist
import transformers

import tempo

STEPS, BATCH, SEQ = 10, 8, 16


def make_model():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
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


def run(rank, world, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        half = BATCH // world
        for inputs, labels in batches():
            sl = slice(rank * half, (rank + 1) * half)
            opt.zero_grad()
            loss_of(model, inputs[sl], labels[sl]).backward()  # DDP averages the ranks' gradients
            opt.step()
        if rank == 0:
            torch.save(copy.deepcopy(model.module.state_dict()), out)
        # Neither rank tears down its Gloo pairs while the other still uses them (a rank that
        # left early made its peer abort in teardown, under load): meet, drop DDP's reducer
        # (it holds the group), then destroy.
        dist.barrier()
        del model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()
