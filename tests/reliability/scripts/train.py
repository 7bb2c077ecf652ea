"""A small deterministic job on the real stack: gloo, resilient.steps, CheckpointManager.

argv: OUT MODE STEPS. MODE: "ok" (train STEPS steps), "fail" (rank 1 raises at step 3), "wait" (after
step 3, keep stepping slowly until told to stop); faults come from RESILIENT_FAULTS (carried out by
resilient.steps). Each rank writes OUT/ready_<rank> (its pid) once
training runs, and rank 0 writes OUT/final.pt (the parameters) when the loop ends normally.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import resilient


def main() -> None:
    out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optim": opt}
    ckpt = resilient.CheckpointManager.from_env()
    start = ckpt.restore(state)
    for step in resilient.steps(start, steps):
        g = torch.Generator().manual_seed(1000 + step)  # the data of a step depends on the step only
        x = torch.randn(8, 16, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        ckpt.save(step, state)
        if step == 3 or step == start:
            with open(os.path.join(out, f".ready_{rank}"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(out, f".ready_{rank}"), os.path.join(out, f"ready_{rank}"))
        if mode == "fail" and rank == 1 and step == 3:
            raise RuntimeError("planned failure")
        if mode == "wait" and step >= 3:
            time.sleep(0.05)
    ckpt.close(timeout=60)
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
