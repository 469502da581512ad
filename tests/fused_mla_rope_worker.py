"""Megatron's fused MLA RoPE (Triton) against its unfused path on CPU, under Triton's interpreter: run as a script
with ``TRITON_INTERPRET=1`` (read when megatron-core's kernels are defined, so before they are imported) by
``tests/test_mla.py``. Prints one JSON line: whether each model fused, and the largest differences of the logits and
of every parameter's gradient on a packed batch."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.*

import torch  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402

from lightning_megatron import tiny_gpt  # noqa: E402
from lightning_megatron.kernels.documents import SequenceLayout  # noqa: E402
from lightning_megatron.parallel.state import one_process  # noqa: E402
from tests.torch_gpt_models import torch_gpt  # noqa: E402

# The interpreter has no device to time the kernels' configurations on: take the first one.
autotuner.Autotuner._bench = lambda self, *args, **kwargs: [0.0, 0.0, 0.0]

# tests/test_mla.py's MLA_YARN with mscale unlike mscale_all_dim (equal ones cancel in the cos/sin)
YARN = {
    "multi_latent_attention": True, "q_lora_rank": 16, "qk_layernorm": True, "rope_type": "yarn",
    "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.8, "mscale_all_dim": 1.0,
}  # fmt: skip


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    with one_process(29612, cpu=True):
        torch.manual_seed(0)
        models = [torch_gpt(tiny_gpt(**YARN), compile_fusions=fused) for fused in (True, False)]
        models[1].load_state_dict(models[0].state_dict())
        tokens = torch.randint(0, 256, (2, 16))
        positions = torch.cat([torch.arange(n) for n in (5, 7, 4)])[None].expand(2, -1)
        documents = (positions == 0).cumsum(1, dtype=torch.int32)
        layout = SequenceLayout(positions=positions, documents=documents, seq_length=16)
        logits, grads = [], []
        for model in models:
            out = model(tokens, positions, None, packed_seq_params=layout)
            out.square().mean().backward()
            logits.append(out.detach())
            grads.append({name: p.grad for name, p in model.named_parameters()})
    result = {
        "fused": [m.config.apply_rope_fusion for m in models],
        "logits": float((logits[0] - logits[1]).abs().max()),
        "logits_scale": float(logits[1].abs().max()),
        "grads": {name: float((grads[0][name] - g).abs().max()) for name, g in grads[1].items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
