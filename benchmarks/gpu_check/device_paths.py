"""Issue 59 item 1's CUDA-only paths, on the device they were written for: sampling on device logits (penalties
and logit bias by index_add_, greedy, top-p without boolean indexing: one host sync, the token's), and KV brought
from the device to the wire whole. On CPU (--dry) the same calls run on host tensors."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.common import Context, Record, need
from benchmarks.gpu_check.decode import syncs_per_step

VOCAB = 4096


def device_paths(ctx: Context, out: Record) -> None:
    need("pipeline.runtime.sampling")
    from pipeline.runtime.sampling import adjust_logits, select_token
    from schemas.sampling import Sampling

    device = ctx.device
    host = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits = host.to(device)
    penalised = Sampling(presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((3, 5.0), (3, 1.0), (7, -2.0)))
    generated = [3, 9, 9, 11]
    gap = float((adjust_logits(logits, generated, penalised).cpu() - adjust_logits(host, generated, penalised)).abs()
                .max())
    out.check("penalties and logit bias: device = host", gap <= 1e-6, gap=gap)
    greedy = [select_token(logits[i:i + 1], Sampling(), None) for i in range(4)]
    out.check("greedy: device = host", greedy == [int(host[i].argmax()) for i in range(4)], tokens=greedy)
    nucleus = Sampling(temperature=0.7, top_p=0.5)
    generator = torch.Generator(device=device).manual_seed(1)
    for i in range(4):
        token = select_token(logits[i:i + 1], nucleus, generator)
        probs = torch.softmax(host[i].double() / nucleus.temperature, dim=-1)
        ordered, order = probs.sort(descending=True)
        allowed = set(order[(ordered.cumsum(0) - ordered) < nucleus.top_p].tolist())
        out.check(f"top-p row {i}: the token is in the nucleus", token in allowed, token=token, nucleus=len(allowed))
    if ctx.cuda:
        syncs = syncs_per_step(lambda: select_token(logits[:1], nucleus, generator))
        out.check("top-p sampling syncs once (the token)", syncs <= 1, syncs=syncs)
    try:
        need("serve.kv.wire")
    except Exception as skip:  # noqa: BLE001 - the wire's own imports (pyarrow, numpy) may be missing: say so
        out.set("wire", f"skipped: {skip}")
    else:
        from serve.kv.wire import from_wire, to_wire

        kv = torch.randn(2, 2, 2, 33, 16).to(device, torch.bfloat16)
        array, dtype = to_wire(kv[:, :, :, 1:])  # a strided slice on the device, as a repaired entry's columns
        back = from_wire(array, dtype)
        out.check("KV from the device to the wire and back: same bits", torch.equal(back, kv[:, :, :, 1:].cpu()))
    out.set("grammar", "not run here: llguidance's mask is tests/serve/engine/test_sampling_cuda.py's (simulated)")
    checks = out.data["checks"]
    out.set("headline", f"{sum(not c['ok'] for c in checks)} of {len(checks)} device-path checks failed")
