"""One GDN layer over ranks: ``torchrun --nproc_per_node 2 docs/examples/kcp_layer.py``.

Every rank holds a replica of the layer and a contiguous shard of one packed
sequence of documents; document states cross rank boundaries inside the layer.
Rank 0 checks the result against the single-rank layer on the whole sequence.
gloo on CPU, NCCL with one GPU per rank.
"""

import os

import torch
import torch.distributed as dist
from gdn_core.layers import SingleRankGatedDeltaNet
from gdn_det_train_kcp import GatedDeltaNetKCP, build_context_det_kcp, partition_det_kcp

cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank) if cuda else torch.device("cpu")

torch.manual_seed(0)  # same parameters and data on every rank
config = dict(hidden_size=64, num_heads=2, num_v_heads=4, head_dim=16, expand_v=1.0)
layer = GatedDeltaNetKCP(**config).to(device)
cu_seqlens = [0, 100, 230, 250, 400]  # 4 documents packed in one sequence
x = torch.randn(1, cu_seqlens[-1], 64, device=device)

plan = partition_det_kcp(cu_seqlens, world, boundary="chunk")  # identical on every rank
context = build_context_det_kcp(plan, rank, device=device, conv_kernel_size=layer.conv_size)
start, stop = plan.token_range(rank)
out = layer(x[:, start:stop], context)  # this rank's shard
out.square().sum().backward()  # collectives inside: every rank runs it
# parameter gradients are this rank's partial sums: add them over ranks, in rank order
# (an all_reduce's order is the backend's: not bitwise repeatable)
for p in layer.parameters():
    parts = [torch.empty_like(p.grad) for _ in range(world)]
    dist.all_gather(parts, p.grad)
    p.grad = torch.stack(parts).sum(0)

outs = [None] * world
dist.all_gather_object(outs, out.detach().cpu())
if rank == 0:
    single = SingleRankGatedDeltaNet(**config).to(device)
    single.load_state_dict(layer.state_dict())
    want, _ = single(x, cu_seqlens=cu_seqlens)
    want.square().sum().backward()
    diff = (torch.cat(outs, dim=1) - want.detach().cpu()).abs().max().item()
    grad = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
               for p, q in zip(layer.parameters(), single.parameters()))
    print(f"{world} ranks, tokens per rank {[plan.token_range(r) for r in range(world)]}: "
          f"max |out - single rank| = {diff:.1e}, parameter gradients {grad:.1e} (relative)")
    assert diff < 1e-4 and grad < 1e-4
dist.destroy_process_group()
