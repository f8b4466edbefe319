"""Bytes a Hugging Face Llama's pipeline sends per microbatch, with position-only values sent or rebuilt.

The model is exported (``torch.export``), split evenly by nodes into S stages, once with every value
live across a cut sent (``split_stages(..., rebuild=False)``: the causal mask, rotary cos and sin go
along with the hidden states) and once as the compiler splits it (rebuilt in the consuming stage).
Per microbatch: the forward's boundary tensors over all cuts, and the backward's gradients (only of
those that need one). Sizes: Llama's head size (128) and a sequence long enough that the mask shows.

Usage: python benchmarks/bench_boundary_bytes.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import publish  # noqa: E402

NAME = "Boundary bytes: position-only values rebuilt"


def llama(hidden: int, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, max_position_embeddings=4096))


def boundary_bytes(hidden: int, seq: int, stages: int) -> dict[str, tuple[int, int, int]]:
    """``{"sent"|"rebuilt": (forward bytes, backward bytes, tensors)}`` per microbatch of batch 1."""
    from pdcompile.passes.export_frontend import export_trace
    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.split_stages import even_assignment, split_stages

    model = llama(hidden, stages)
    x = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    gm = export_trace(model, (x,))
    propagate_shapes(gm, (x,))
    assign = even_assignment(gm, stages)
    out = {}
    for label, rebuild in (("sent", False), ("rebuilt", True)):
        split = split_stages(gm, assign, model, rebuild=rebuild)
        metas = [m for st in split.stages[:-1] for m in st.output_meta]
        out[label] = (sum(m.nbytes for m in metas), sum(m.nbytes for m in metas if m.requires_grad), len(metas))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small case; prints, writes nothing")
    args = ap.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    cases = [(128, 64, 2)] if args.quick else [(512, 512, 2), (512, 1024, 2), (512, 1024, 4), (1024, 2048, 2)]
    mib = 2.0 ** 20
    rows = ["| hidden | tokens | stages | sent: tensors, forward + backward MiB | rebuilt: tensors, forward + backward "
            "MiB | saved |", "|---|---|---|---|---|---|"]
    for hidden, seq, stages in cases:
        b = boundary_bytes(hidden, seq, stages)
        (fs, bs, ns), (fr, br, nr) = b["sent"], b["rebuilt"]
        rows.append(f"| {hidden} | {seq} | {stages} | {ns}: {fs / mib:.2f} + {bs / mib:.2f} | {nr}: {fr / mib:.2f} + "
                    f"{br / mib:.2f} | {1 - (fr + br) / (fs + bs):.0%} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        "Llama (head size 128, batch 1 per microbatch), exported and split evenly by nodes. Per microbatch, "
        "summed over the cuts: what the forward sends (hidden states; before: with the causal mask `[1,1,T,T]` "
        "bool and rotary cos/sin `[1,T,128]` fp32 per cut) and the backward's gradients (of the hidden states only, "
        "before and after). Training is bitwise the same (tests/test_position_values.py). Byte counts do not "
        f"depend on the load (2-core CPU, shared; load average at the start {' '.join(load)}).",
        "",
        *rows,
    ])
    publish(NAME, body, "python benchmarks/bench_boundary_bytes.py", write=not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
