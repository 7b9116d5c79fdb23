"""commref.ep: MoE dispatch and combine (expert parallelism) in DeepEP's two modes,
high-throughput and low-latency, on the device API alone. The implementation lives in
the collectives layer, beside the device communicator it is built on
(collectives/device_api/ep_buffer.py, where the benchmark can reach it; its docstring
is the user's guide), the kernels in device_kernels/kernels/device_api/ep.cu, the
DeepEP-style checks in collectives/device_api/ep_check.py.

    from commref import ThreadWorld, ep
    def rank(world):
        with ep.Buffer(world, num_experts=8, hidden=256, max_tokens_per_rank=32, num_topk=2) as buf:
            x, topk_idx, topk_weights = ep.make_inputs(world.rank, world.size, 32, 256, 8, 2)
            recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle = buf.dispatch(x, topk_idx, topk_weights)
            combined_x, _ = buf.combine(recv_x, handle)
    ThreadWorld.run(4, rank)

`python -m commref.ep --np 4` (ranks as threads; under mpiexec without --np, the MPI
job's ranks) runs both modes on DeepEP-style inputs and prints what the checks found.
"""

from commref.collectives.device_api.ep_buffer import *  # noqa: F401,F403
from commref.collectives.device_api.ep_buffer import __all__ as _ep_all
from commref.collectives.device_api.ep_check import *  # noqa: F401,F403
from commref.collectives.device_api.ep_check import __all__ as _check_all

__all__ = [*_ep_all, *_check_all]


def _main(argv=None) -> int:
    """Layout, high-throughput and low-latency dispatch and combine on DeepEP-style inputs,
    each checked exactly (collectives/device_api/ep_check.py), run twice with the same inputs (equal
    digests of what was received), on `--np` ranks as threads or the MPI job's ranks."""
    import argparse

    import numpy as np

    from commref._selfcheck import add_peer_arguments, run_ranks, use_rank_stream
    from commref.collectives.device_api import ep_check
    from commref.collectives.device_api.ep_buffer import Buffer
    from commref.collectives.options import resolve_device

    p = argparse.ArgumentParser(prog="python -m commref.ep", description=_main.__doc__)
    p.add_argument("--np", type=int, help="ranks as threads of this process (default: the MPI job's ranks)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=3)
    add_peer_arguments(p)
    p.add_argument("--backend", default="auto")
    p.add_argument("--protocol", default="auto")
    p.add_argument("--seed", type=int, default=0, help="inputs and the unordered wire")
    args = p.parse_args(argv)
    device = resolve_device(args.device)

    def body(world):
        xp = use_rank_stream(world) if device == "cuda" else np
        r, n, E, K, T = world.rank, world.size, args.experts, args.topk, args.tokens
        gin = (
            dict(wire=args.wire, network=args.network, backend=args.backend, seed=args.seed)
            if args.path != "lsa"
            else {}
        )
        with Buffer(
            world,
            num_experts=E,
            hidden=args.hidden,
            max_tokens_per_rank=T,
            num_topk=K,
            low_latency_mode=True,
            protocol=args.protocol,
            device=device,
            path=args.path,
            **gin,
        ) as buf:
            x, topk, w = ep_check.make_inputs(r, n, T, args.hidden, E, K, seed=args.seed)
            all_topk, all_w = world.allgather(topk), world.allgather(w)
            dx = xp.asarray(x.view(np.uint16)) if device == "cuda" else x
            on_device = (dx, xp.asarray(topk), xp.asarray(w))
            problems, digests = [], []
            for _ in range(2):
                found, received = ep_check.checked_round(buf, (x, topk, w), all_topk, all_w, on_device)
                problems += found
                digests.append(received)
            if digests[0] != digests[1]:
                problems.append(f"rank {r}: the same inputs received differently: digests {digests}")
            return problems, buf.protocol, buf.cell, buf.dc.backend

    results, reporting = run_ranks(args.np, body)
    problems = [q for res in results for q in res[0]]
    if reporting:
        _, protocol, cell, backend = results[0]
        print(
            f"# commref.ep: {len(results)} ranks, device {device}, path {args.path}, protocol {protocol} "
            f"(study cell {cell}), backend {backend}: layout, high-throughput and low-latency dispatch and "
            f"combine twice: {len(problems)} problems"
        )
        for q in problems[:20]:
            print("  " + q)
    return 0 if not problems else 1


if __name__ == "__main__":
    import sys

    sys.exit(_main())
