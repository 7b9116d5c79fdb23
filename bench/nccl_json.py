"""nccl-tests' own JSON document (-J FILE), built from commref's results document
(output.document), so that tools written for nccl-tests' files read commref's runs.

The layout is nccl-tests' (its src/util.cu): top level "version" (the layout's version,
NCCL_TESTS_JSON_VERSION), "start_time", "args", "config" (its run parameters and
"devices", one per rank), "results" (one per row: size, count, type, redop, root, then
per placement "out_of_place" / "in_place" with time, alg_bw, bus_bw, nwrong and, with
-I 1, "out_of_place_per_iter" / "in_place_per_iter" with the per-iteration statistics
of measure.iteration_stats), "out_of_bounds", "average_bus_bandwidth", "errors" and
"end_time". nccl-tests' spellings are kept where they are odd: booleans are the strings
"true" and "false", root is the %6i-formatted string nccl-tests prints.

What differs: the environment (nccl-tests' "env", every variable of rank 0) is left out,
since it may hold secrets; "commref_version" stands where nccl-tests writes
"nccl_version"; each result's "experiment_name" is the row's series (several series or
-N cycles give several results per size, in the table's order); skipped_iterations is
0, since -w's warmup calls are never timed.
"""

from __future__ import annotations

import sys
import time

NCCL_TESTS_JSON_VERSION = 2
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _flag(value) -> str:
    return "true" if value else "false"


def _placement(result: dict | None) -> dict | None:
    if result is None:
        return None
    return {
        "time": result["time_us"],
        "alg_bw": result["algbw"],
        "bus_bw": result["busbw"],
        "nwrong": None if result.get("wrong") is None else float(result["wrong"]),
    }


def _per_iter(result: dict | None) -> dict | None:
    stats = result and result.get("per_iter")
    return None if stats is None else {"skipped_iterations": 0, **stats}


def _result(row: dict, iters: int) -> dict:
    out = {
        "size": row["size"],
        "count": row["count"],
        "type": row["type"],
        "redop": row["redop"],
        "root": f"{row['root']:6d}",
    }
    for key in ("out_of_place", "in_place"):
        out[key] = _placement(row[key])
        stats = _per_iter(row[key])
        if stats is not None:
            out[f"{key}_per_iter"] = stats
    out["actual_iterations"] = iters
    out["experiment_name"] = row["series"]
    return out


def _config(params: dict, env: dict) -> dict:
    steps = {"step_factor": params["stepfactor"]} if params["stepfactor"] > 1 else {"step_bytes": params["stepbytes"]}
    return {
        "nthreads": params["nthreads"],
        "ngpus": 1 if env["device"] == "cuda" else 0,
        "minimum_bytes": params["minbytes"],
        "maximum_bytes": params["maxbytes"],
        **steps,
        "warmup_iters": params["warmup_iters"],
        "iterations": params["iters"],
        "aggregated_iterations": params.get("agg_iters", 1),
        "validation": params["check"],
        "graph": 0,
        "blocking_collectives": _flag(params["blocking"]),
        "per_iter_timing": _flag(params.get("iteration_stats")),
        "parallel_init": _flag(False),
        "devices": [
            {
                "rank": r["rank"],
                "group": 0,
                "pid": r["pid"],
                "hostname": r["host"],
                "device": -1 if r.get("device_id") is None else r["device_id"],
                "device_hex": r.get("pci_bus") or "",
                "device_info": r["device"],
            }
            for r in env["ranks"]
        ],
    }


def nccl_tests_document(doc: dict, argv: list[str] | None = None, now: float | None = None) -> dict:
    """nccl-tests' document of the run commref's results document `doc` describes;
    `argv` (default sys.argv) its command line, `now` (default: the clock) its end."""
    end = time.time() if now is None else now
    params, rows = doc["params"], doc["rows"]
    cells = [r[k] for r in rows for k in ("out_of_place", "in_place") if r[k]]
    wrong = sum(c["wrong"] or 0 for c in cells)
    return {
        "version": NCCL_TESTS_JSON_VERSION,
        "start_time": time.strftime(_TIME_FORMAT, time.localtime(end - doc["elapsed_s"])),
        "args": list(sys.argv if argv is None else argv),
        "commref_version": doc["environment"]["commref"],
        "config": _config(params, doc["environment"]),
        "results": [_result(r, params["iters"]) for r in rows],
        "out_of_bounds": {"count": wrong, "okay": _flag(wrong == 0)},
        "average_bus_bandwidth": {
            "bandwidth": sum(c["busbw"] for c in cells) / len(cells) if cells else 0.0,
            "okay": "unchecked",
        },
        "errors": [],
        "end_time": time.strftime(_TIME_FORMAT, time.localtime(end)),
    }
