"""A single-process training loop for tests/preempt/test_session.py. It sends itself
``--signal`` after ``--notice-at``; ``--no-stop`` never calls should_stop (the old SIGTERM
behaviour must hold). Prints one line per step: ``STEP <n> <loss hex>``."""

import argparse
import os
import signal

import torch

import tierckpt

p = argparse.ArgumentParser()
p.add_argument("tier1")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--notice-at", type=int, default=None)
p.add_argument("--signal", default="SIGTERM")
p.add_argument("--no-stop", action="store_true")
p.add_argument("--tier2", default=None)
a = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = tierckpt.TrainState(model=model, optimizer=opt)
with tierckpt.CheckpointManager(tier1=a.tier1, tier2=a.tier2) as ckpt:
    restored = ckpt.restore(state)
    for step in range(restored.step + 1 if restored else 0, a.steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"STEP {step} {loss.item().hex()}", flush=True)
        if step == a.notice_at and not os.environ.get("NOTICE_DONE"):
            os.kill(os.getpid(), signal.Signals[a.signal])
        if step % 10 == 9 or ckpt.should_save(step):
            ckpt.save(step, state)
        if not a.no_stop and ckpt.should_stop(step):
            break
print("END", flush=True)
