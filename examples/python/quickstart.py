# SPDX-License-Identifier: Apache-2.0
"""moecap from Python: capture a router's top-k in two layers, commit the
tokens to their KV slots, read a finished request back, invalidate a freed
slot, and look at the host cache zero-copy through NumPy.

    pip install . numpy torch          # once: the wheel (libmoecap.so.1 + the extension), and what this uses
    python examples/python/quickstart.py
"""
import numpy as np
import torch

import moecap

LAYERS, TOP_K, EXPERTS = 2, 2, 8

config = moecap.Config(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=64,
                       max_running_requests=8, chunked_prefill_size=16, weight_dtype=torch.bfloat16)
with moecap.Capturer(config) as cap:                         # or moecap.Capturer(num_layers=..., ...)
    print("plan:", cap.plan)                                 # moecap.Plan: rows, dtypes ('u8'), bytes
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    routers = [torch.randn(16, EXPERTS, generator=torch.Generator().manual_seed(1 + l)) for l in range(LAYERS)]
    for layer, router in enumerate(routers):
        weights, ids = torch.topk(torch.softmax(hidden @ router, dim=-1), TOP_K)
        cap.capture(layer, ids.to(torch.int32), weights)   # borrowed, no copy
    cap.commit(np.array([10, -1, 11]))                      # token 1 is padding: dropped

    ids, weights = cap.read(np.array([10, 11]), dtype=np.int64,
                            weights_out=np.zeros((2, LAYERS, TOP_K), dtype=np.float32))
    print("request rows [token, layer, k]:", ids.tolist())
    print("routing weights (bf16-stored):", np.round(weights.astype(np.float64), 3).tolist())

    cap.invalidate(np.array([11]))                           # its KV freed: slot 11 reads -1 from now on
    print("slot 11 after invalidate:", cap.read(np.array([11]))[0].tolist())

    host = np.from_dlpack(cap.export("host_ids"))            # the whole host cache, zero-copy
    print("host cache", host.shape, host.dtype, "slot 10:", host[10].tolist())
    print("errors:", cap.errors())
    try:
        cap.capture(LAYERS, np.zeros((1, TOP_K), dtype=np.int32))
    except moecap.MoecapError as e:
        print("refused as it should be:", e)
