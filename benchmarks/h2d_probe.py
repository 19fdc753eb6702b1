"""How fast chunks go up, by the kind of host memory they come from (GPU).

The hardware profile times host-to-device copies from torch's pinned memory (``cudaHostAlloc``, a
256 MiB block); protrain's chunk stores hold blocks over 64 MiB in anonymous memory registered
with ``cudaHostRegister`` where torch cannot pin them at their exact size (torch 2.11), and an
offloaded chunk without a transfer copy goes up as fp32 through a device staging piece and a cast
(``runtime/chunk_transfers.upload``). On an H100 the steps' copies ran at 43 GB/s by their own
durations against 55 GB/s profiled (``results/oom_sweep_h100_run65.md``). This probe copies
``--blocks`` distinct host blocks of each ``--block-mib`` size up, back to back on a side stream,
from each source, alone and beside dense products on the compute stream:

* ``torch pinned``: ``torch.empty(..., pin_memory=True)`` (the profile's kind);
* ``registered``: ``pinned.registered_host_empty`` (protrain's chunks over 64 MiB on torch 2.11);
* ``registered, fp32 -> bf16``: the same, through ``chunk_transfers.upload`` into a bf16 buffer
  (bytes counted in fp32): a staging piece and a cast on the copy stream, the way an offloaded
  chunk without a transfer copy goes up; its values checked against ``Tensor.to``'s;
* ``pageable``: plain host memory.

    python benchmarks/h2d_probe.py --out $OUT/h2d_probe_h100
"""

from __future__ import annotations

import argparse
import statistics

import torch
from results_io import write_json, write_table


def random_registered(n: int) -> torch.Tensor:
    from protrain_fx.machine import pinned

    return pinned.registered_host_empty(n, torch.float32).normal_()


def rate(src: list, dst: torch.Tensor, stream, busy: bool, upload) -> float:
    """Bytes per second of copying every block of ``src`` into ``dst`` on ``stream``, median of 3,
    with products running on the current stream when ``busy``."""
    a = torch.randn(8192, 8192, device=dst.device, dtype=torch.bfloat16)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        if busy:
            for _ in range(60):  # ~90 ms of products, longer than the copies
                a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for s in src:
                upload(dst, s)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    return sum(s.nbytes for s in src) / statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-mib", default="64,96,256,1024")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from protrain_fx.machine import pinned
    from protrain_fx.runtime import chunk_transfers

    def plain(dst, s):
        dst.copy_(s, non_blocking=True)

    def cast(dst, s):
        chunk_transfers.upload(dst, s)

    sources = {
        "torch pinned": (lambda n: torch.empty(n, dtype=torch.float32, pin_memory=True), plain),
        "registered": (lambda n: pinned.registered_host_empty(n, torch.float32), plain),
        "registered, fp32 -> bf16": (random_registered, cast),
        "pageable": (lambda n: torch.empty(n, dtype=torch.float32), plain),
    }
    stream = torch.cuda.Stream()
    exact = []
    rows = []
    for mib in [int(x) for x in args.block_mib.split(",")]:
        numel = mib * 2**20 // 4
        for name, (make, upload) in sources.items():
            src = [
                make(numel) if upload is cast else make(numel).fill_(1.0)
                for _ in range(args.blocks)
            ]
            casts = upload is cast
            dtype = torch.bfloat16 if casts else torch.float32
            dst = torch.empty(numel, dtype=dtype, device="cuda")
            row = {"block_mib": mib, "source": name}
            for busy in (False, True):
                row["busy_gbs" if busy else "alone_gbs"] = round(
                    rate(src, dst, stream, busy, upload) / 1e9, 2
                )
            if casts:  # the last block's values, rounded as Tensor.to rounds them
                row["exact"] = bool(torch.equal(dst.cpu(), src[-1].to(torch.bfloat16)))
                exact.append(row["exact"])
            rows.append(row)
            print(row, flush=True)
            del src, dst
            chunk_transfers.release_pieces()
            torch.cuda.empty_cache()
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "casts_exact": all(exact),
    }
    write_json(args.out, out)
    lines = [
        f"# Host-to-device copies by source ({out['device']}, torch {out['torch']})",
        "",
        f"`python benchmarks/h2d_probe.py --out OUT`: {args.blocks} distinct host blocks per size "
        "copied up back to back on a side stream, median of 3 after one warm-up; beside products: "
        "8192^3 bf16 products queued on the compute stream first. GB/s of fp32 bytes. Casts "
        f"bit for bit `Tensor.to`'s: {out['casts_exact']}.",
        "",
        "| block MiB | source | alone GB/s | beside products GB/s |",
        "|---|---|---|---|",
    ] + [f"| {r['block_mib']} | {r['source']} | {r['alone_gbs']} | {r['busy_gbs']} |" for r in rows]
    write_table(args.out, lines, echo=3)


if __name__ == "__main__":
    main()
