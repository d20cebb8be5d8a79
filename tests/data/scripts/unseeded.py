"""A tiny training script that is nondeterministic: noise from an unseeded NumPy Generator."""

import numpy as np
import torch

rng = np.random.default_rng()
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.ones(4, 8) + torch.from_numpy(rng.normal(size=(4, 8)).astype(np.float32))
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
